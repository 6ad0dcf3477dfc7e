"""The README's generated sections match the code: every config key and metric is documented."""

from __future__ import annotations

from pathlib import Path

from agent.cli import docgen

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_reference_sections_are_up_to_date():
    text = README.read_text()
    for name, body in docgen.generated().items():
        assert docgen.replace_in(text, name, body) == text, (
            f"README.md's {name} is stale: run python -m agent.cli.docgen --write README.md")


def test_every_config_key_and_metric_appears_in_the_readme():
    text = README.read_text()
    from agent.config.config import Config
    from agent.model.config_schema import describe

    for key, _, _ in describe(Config):
        assert f"`{key}`" in text or key.split(".")[0] in docgen.LIST_SECTIONS
    assert "`maintd_imds_requests_total`" in text and "`maintd_handler_runs_total`" in text
