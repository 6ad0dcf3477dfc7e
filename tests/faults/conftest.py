from tests.e2e.conftest import start_agent, start_emulator  # noqa: F401 - the same process fixtures
