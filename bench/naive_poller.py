"""The documentation's approach, for comparison: a new connection per poll, once a second.

Modelled on Microsoft's Python samples for Scheduled Events: the older one (urllib.request) and the
current one in learn.microsoft.com's "Scheduled Events for Linux VMs" (module-level
`requests.get`, no session). Both open a new TCP connection for every poll, decode the JSON and
sleep 1 s. Usage: python bench/naive_poller.py BASE_URL [urllib|requests]
"""

import json
import sys
import time
import urllib.request

BASE = sys.argv[1].rstrip("/") + "/metadata/scheduledevents"
CLIENT = sys.argv[2] if len(sys.argv) > 2 else "urllib"


def get_scheduled_events_urllib():
    req = urllib.request.Request(BASE + "?api-version=2020-07-01")
    req.add_header("Metadata", "true")
    resp = urllib.request.urlopen(req)
    return json.loads(resp.read())


def get_scheduled_events_requests():
    import requests

    resp = requests.get(BASE, headers={"Metadata": "true"}, params={"api-version": "2020-07-01"})
    return resp.json()


def main():
    get_scheduled_events = get_scheduled_events_requests if CLIENT == "requests" else get_scheduled_events_urllib
    while True:
        try:
            doc = get_scheduled_events()
            for event in doc["Events"]:
                if event["EventStatus"] == "Scheduled":
                    pass
        except Exception as exc:  # the samples print and carry on
            print(exc, file=sys.stderr)
        time.sleep(1)


if __name__ == "__main__":
    main()
