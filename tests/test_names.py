"""The one validator for names that become storage keys (`tinkerless.storage.names`), and the store's second wall.

Every kind (run id, checkpoint name, policy name, tenant name, file name) refuses traversal, absolute paths,
NUL and other control characters, Unicode look-alikes of '.' and '/', and names over the kind's length; what
it accepts is always one safe key part. The server's boundaries use it: a path-shaped name never reaches storage.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings, strategies as st

from tinkerless.errors import InvalidRequest, UserError
from tinkerless.storage import ObjectStore, validate_key
from tinkerless.storage.names import (
    CHECKPOINT_NAME, FILE_NAME, MAX_NAME_BYTES, POLICY_NAME, RUN_ID, TENANT_NAME, check_file_key, check_name,
)

RULES = [RUN_ID, CHECKPOINT_NAME, POLICY_NAME, TENANT_NAME, FILE_NAME]

HOSTILE = {
    "traversal": ["..", ".", "../x", "x/../y", "../../server/api_keys.json", "..\\x", ".hidden"],
    "absolute": ["/etc/passwd", "/", "C:\\x", "\\\\server\\share"],
    "nul": ["\x00", "x\x00", "\x00.."],
    "control": ["x\n", "\ry", "a\tb", "\x1b[2J", "\x7f", "a\u2028b", "\u202eevil", "\ufeffbom", "a\u200bb"],
    "confusable": ["\u2024\u2024", "\uff0e\uff0e", "a\u2215b", "a\u2044b", "\uff0fetc", "\u0430dmin", "caf\u00e9",
                   "\uff41", "x\u0338"],
    "over-long": ["a" * 256, "a" * 10_000],
    "empty": [""],
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.what)
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_every_kind_refuses_every_hostile_class(rule, kind):
    for value in HOSTILE[kind]:
        with pytest.raises(InvalidRequest) as info:
            check_name(value, rule)
        assert info.value.category == "user" and rule.what in info.value.message
        assert "\n" not in info.value.message and "\x00" not in info.value.message  # shown escaped


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.what)
def test_each_kinds_own_length_and_what_it_accepts(rule):
    assert check_name("a" * rule.max_length, rule)
    with pytest.raises(InvalidRequest, match="bytes long"):
        check_name("a" * (rule.max_length + 1), rule)
    for good in ("a", "A9", "x-y", "run_01" if "_" in rule.punctuation else "run-01"):
        assert check_name(good, rule) == good
    for wrong_type in (None, 5, b"bytes", ["a"]):
        with pytest.raises(InvalidRequest, match="must be a string"):
            check_name(wrong_type, rule)


@settings(max_examples=400, deadline=None)
@given(rule=st.sampled_from(RULES), value=st.text(min_size=0, max_size=300))
def test_whatever_a_name_passes_is_one_safe_key_part(rule, value):
    try:
        check_name(value, rule)
    except InvalidRequest:
        return
    assert 0 < len(value.encode()) <= min(rule.max_length, MAX_NAME_BYTES)
    assert set(value) <= set(string.ascii_letters + string.digits + rule.punctuation + rule.first)
    assert value not in (".", "..") and not value.startswith(".") and "/" not in value
    assert validate_key(f"tenants/alice/runs/{value}/state.json")


def test_file_keys_and_prefixes_check_each_part():
    assert check_file_key("adapter/adapter_model.safetensors", where="files") == "adapter/adapter_model.safetensors"
    assert check_file_key("", where="file_prefix", allow_empty=True, trailing_slash=True) == ""
    assert check_file_key("policies/black/", where="file_prefix", trailing_slash=True) == "policies/black/"
    for bad in ("policies/../", "policies//", "/abs/", "..", "x", "a\n/", "\u2024\u2024/"):
        with pytest.raises(InvalidRequest):
            check_file_key(bad, where="file_prefix", allow_empty=True, trailing_slash=True)
    for bad in ("../x", "a//b", "a/./b", "x\x00", "a/" + "b" * 300, "/x"):
        with pytest.raises(InvalidRequest):
            check_file_key(bad, where="files")


def test_the_store_is_the_second_wall(tmp_path):
    store = ObjectStore(str(tmp_path / "root"))
    tenant = store.child("tenants/alice")
    for key in ("../bob/x", "a/../../x", "/etc/passwd", "x\n", "a\x00", "a/" + "b" * 256, "a\u202eb", "\\x"):
        with pytest.raises(UserError):
            tenant.put(key, b"x")
    tenant.put("runs/ok/state.json", b"{}")
    assert [p.name for p in (tmp_path / "root" / "tenants" / "alice" / "runs" / "ok").iterdir()] == ["state.json"]
