"""The budget's record against Azurite (a real store's conditional writes): 50 racers for 1 place, exactly 1
holder, every time; a record nobody wrote is never taken as free places."""

from __future__ import annotations

import threading

import pytest

from agent.coordination.store.budget import step
from agent.coordination.store.budget_rules import TAKE, Me, parse_places, places_blob
from agent.coordination.store.store_protocol import StoreError
from tests.azurite import Azurite, azurite  # noqa: F401 - the fixture
from tests.test_blob_store import open_store


@pytest.mark.parametrize("places", [1, 3])
def test_fifty_racers_for_the_places_exactly_that_many_holders(azurite: Azurite, places: int) -> None:
    store = open_store(azurite)
    racers = 50
    for round_ in range(3):
        group = f"race{places}-{round_}"
        barrier = threading.Barrier(racers)
        results: list[str] = []
        lock = threading.Lock()

        def race(vm: str) -> None:
            barrier.wait()
            try:
                done = step(store, group, TAKE, Me(vm), f"e-{vm}", lambda n: places, "none", 1800)
                result = done.result
            except StoreError as exc:  # rewritten by others too often: tried again on the VM's next tick
                result = exc.outcome
            with lock:
                results.append(result)

        threads = [threading.Thread(target=race, args=(f"vm_{i}",)) for i in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        found = store.read_body(places_blob(group))
        assert found is not None
        record = parse_places(found[0])
        assert not isinstance(record, str)
        assert len(record.holders) == places == results.count("acquired"), results
        assert len(record.holders) + len(record.waiting) <= racers


def test_a_record_nobody_wrote_is_never_free_places(azurite: Azurite) -> None:
    store = open_store(azurite)
    store.write_body(places_blob("junk"), b'{"holders": []}', None)
    with pytest.raises(StoreError) as err:
        step(store, "junk", TAKE, Me("vm_0"), "e", lambda n: 1, "none", 1800)
    assert err.value.outcome == "unreadable"
