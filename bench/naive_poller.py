"""The documentation's approach, for comparison: a new connection per poll, once a second.

Modelled on Microsoft's Python sample for Scheduled Events (urllib.request, json.loads, a sleep
loop). Usage: python bench/naive_poller.py BASE_URL
"""

import json
import sys
import time
import urllib.request

METADATA_URL = sys.argv[1].rstrip("/") + "/metadata/scheduledevents?api-version=2020-07-01"


def get_scheduled_events():
    req = urllib.request.Request(METADATA_URL)
    req.add_header("Metadata", "true")
    resp = urllib.request.urlopen(req)
    return json.loads(resp.read())


def main():
    while True:
        try:
            doc = get_scheduled_events()
            for event in doc["Events"]:
                if event["EventStatus"] == "Scheduled":
                    pass
        except Exception as exc:  # the sample prints and carries on
            print(exc, file=sys.stderr)
        time.sleep(1)


if __name__ == "__main__":
    main()
