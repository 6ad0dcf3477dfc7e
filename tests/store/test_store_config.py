"""The store backend's config: check-config names file:line for each mistake, and says where records go."""

from __future__ import annotations

import pytest

from tests.cli.test_cli import maintd

STORE = """coordination:
  backend: azure_blob
  azure_blob:
{body}"""


@pytest.mark.parametrize("body, where, says", [
    ("    account_url: https://acct.blob.core.windows.net\n    credentail: managed_identity\n", ":5:5:",
     "did you mean 'credential'"),
    ("    account_url: http://acct.blob.core.windows.net\n", ":4:5:", "https://ACCOUNT.blob.core.windows.net"),
    ("    account_url: https://acct.blob.core.windows.net\n    container: Maintd\n", ":5:5:", "lower-case"),
    ("    account_url: https://acct.blob.core.windows.net\n    credential: key\n", ":5:5:", "managed_identity"),
    ("    account_url: https://acct.blob.core.windows.net\n    client_id: me\n", ":5:5:", "GUID"),
    ("    connection_string_file: /etc/maintd/storage.conn\n"
     "    client_id: 0f7c6a3e-1111-4a2b-9c3d-123456789abc\n", ":5:5:", "carries its own credentials"),
    ("    container: maintd\n", ":3:3:", "set account_url"),
])
def test_check_config_names_the_line_of_each_store_mistake(write_config, body: str, where: str, says: str) -> None:
    """A typo, an http URL, a container name Azure refuses, an unknown credential, a client id that is not a
    GUID, a client id beside a connection string, no endpoint: refused with file:line:column and the fix."""
    path = write_config(STORE.format(body=body))
    done = maintd("check-config", str(path))
    assert done.returncode == 1
    assert f"{path}{where}" in done.stderr and says in done.stderr, done.stderr


def test_the_backend_without_its_store_is_refused(write_config) -> None:
    """backend: azure_blob with no azure_blob section: refused, with an example of what to write."""
    path = write_config("coordination:\n  backend: azure_blob\n")
    done = maintd("check-config", str(path))
    assert done.returncode == 1 and "account_url: https://ACCOUNT.blob.core.windows.net" in done.stderr


def test_check_config_says_where_records_go_and_how_this_vm_authenticates(write_config) -> None:
    """A valid store config: check-config names the endpoint, the container and the identity."""
    path = write_config(STORE.format(body="    account_url: https://acct.blob.core.windows.net\n"
                                          "    client_id: 0f7c6a3e-1111-4a2b-9c3d-123456789abc\n"))
    done = maintd("check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert "https://acct.blob.core.windows.net container maintd" in done.stdout
    assert "managed identity 0f7c6a3e-1111-4a2b-9c3d-123456789abc, token from IMDS" in done.stdout


BUDGET = STORE.format(body="    account_url: https://acct.blob.core.windows.net\n") + "  budget:\n{budget}"


def test_check_config_warns_that_advertise_no_longer_routes_wake_hints(write_config) -> None:
    """An operator who set `advertise` to reach members: check-config warns that it is shown only and names
    wake_url; with wake_url set, it says where hints go and does not warn."""
    path = write_config(BUDGET.format(budget="    group: web\n    advertise: http://10.0.0.5:8088\n"))
    done = maintd("check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert "warning: coordination.budget.advertise" in done.stdout and "wake_url" in done.stdout
    path = write_config(BUDGET.format(budget="    group: web\n    advertise: http://10.0.0.5:8088\n"
                                             "    wake_url: http://{name}:8088\n"))
    done = maintd("check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert "budget wake hints: to http://{name}:8088" in done.stdout and "warning" not in done.stdout


@pytest.mark.parametrize("wake_url, says", [("http://{vm}:8088", "{vm}"), ("http://10.0.0.5:8088", "use {name}")])
def test_a_wake_url_that_is_no_template_of_a_name_is_refused(write_config, wake_url: str, says: str) -> None:
    path = write_config(BUDGET.format(budget=f"    group: web\n    wake_url: {wake_url}\n"))
    done = maintd("check-config", str(path))
    assert done.returncode == 1 and "wake_url" in done.stderr and says in done.stderr, done.stderr
