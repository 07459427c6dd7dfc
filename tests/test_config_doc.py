"""docs/configuration.md is generated from the code's key tables, and says what they say."""

from __future__ import annotations

from fusion import config_doc
from fusion.params import RUNCONFIG_DEFAULTS, load_params
from workers.config_keys import MODEL_KEYS
from workers.engine import EngineConfig


def test_the_page_matches_the_code():
    assert config_doc.PAGE.read_text() == config_doc.render(), (
        "docs/configuration.md is stale: run `python -m fusion.config_doc --write`")


def test_every_key_the_loader_accepts_is_documented(tmp_path):
    page = config_doc.PAGE.read_text()
    for name in [*RUNCONFIG_DEFAULTS, *(k.name for k in MODEL_KEYS)]:
        assert f"| `{name}` |" in page, name
    # the engine's own defaults are the ones the table gives
    table = {k.name: k.default for k in MODEL_KEYS}
    assert table["max_batch_size"] == EngineConfig().max_batch_size
    assert table["max_batch_tokens"] == EngineConfig().max_batch_tokens
    # a params file that sets nothing gets the table's runconfig defaults
    p = tmp_path / "p.yaml"
    p.write_text("variants: {a: {model: {source: 'tiny:llama'}}}\n")
    run = load_params(p)["runconfig"]
    assert {k: v for k, v in run.items() if k != "retry_delays"} == {
        k: v for k, v in RUNCONFIG_DEFAULTS.items() if k != "retry_delays"}
    assert list(run["retry_delays"]) == RUNCONFIG_DEFAULTS["retry_delays"]
