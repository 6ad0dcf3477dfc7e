"""The budget's record against Azurite (a real store's conditional writes): 50 racers for 1 place, exactly 1
holder, every time; a record nobody wrote is never taken as free places."""

from __future__ import annotations

import pytest

from agent.coordination.store.store_protocol import StoreError
from agent.fleet.budget import step
from agent.fleet.budget_rules import TAKE, Me, parse_places, places_blob
from tests.azurite import Azurite, azurite  # noqa: F401 - the fixture
from tests.store.test_blob_store import at_once, open_store


@pytest.mark.parametrize("places", [1, 3])
def test_fifty_racers_for_the_places_exactly_that_many_holders(azurite: Azurite, places: int) -> None:
    store = open_store(azurite)
    racers = 50
    for round_ in range(3):
        group = f"race{places}-{round_}"

        def race(vm: str, group: str = group) -> str:
            try:
                return step(store, group, TAKE, Me(vm), f"e-{vm}", lambda n: places, "none", 1800).result
            except StoreError as exc:  # rewritten by others too often: tried again on the VM's next tick
                return exc.outcome

        results = at_once(racers, race)
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
