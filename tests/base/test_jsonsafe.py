"""Untrusted JSON: refused before parsing when too large or too deep, never a RecursionError."""

import json

import pytest

from agent.trust import jsonsafe


def test_a_normal_document_parses_as_json_loads_would():
    doc = {"DocumentIncarnation": 3, "Events": [{"EventId": "a", "Resources": ["vm-1"], "Description": "[{x}]"}]}
    assert jsonsafe.loads(json.dumps(doc), max_bytes=10_000) == doc


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"a":' * 100 + "1" + "}" * 100, "[" * 100_000])
def test_deep_nesting_is_refused_as_a_value_error(text):
    with pytest.raises(ValueError, match="nested"):
        jsonsafe.loads(text, max_bytes=1_000_000)


def test_brackets_inside_strings_do_not_count_as_nesting():
    text = json.dumps({"Description": "[" * 500 + '\\"' + "{" * 500})
    assert jsonsafe.loads(text, max_bytes=10_000)["Description"].startswith("[[[")


def test_too_large_is_refused_before_parsing():
    with pytest.raises(ValueError, match="bytes"):
        jsonsafe.loads(b" " * 2000 + b"{}", max_bytes=1000)


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b'{"a": "\xc3"}', b"not json", b""])
def test_garbage_is_a_value_error(raw):
    with pytest.raises(ValueError):
        jsonsafe.loads(raw, max_bytes=1000)


@pytest.mark.parametrize("value", ["a\\n[[[", "\\\\", '\\\\"[', "\\u005b[[", '"]]]{'])
def test_escapes_inside_strings_do_not_confuse_the_depth_scan(value):
    text = json.dumps([{"x": value, "y": ["[" * 40]}])
    assert jsonsafe.depth(text.encode()) == 3
    assert jsonsafe.loads(text, max_bytes=10_000)[0]["x"] == value
