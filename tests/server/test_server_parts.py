"""The server's pure parts: tenant salts, derived seeds, streamed deltas, usage, settings, the
interpreter setting of the serving process."""

from __future__ import annotations

import inspect
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.chat_template import RESERVED_TEMPLATE_NAMES, ChatTemplate
from kernels.build_log import CUDA_GRAPH, CUDNN_LOAD, BuildLog
from server.auth import key_salt, tenant_salt
from server.cli import SERVE_SWITCH_INTERVAL_S, _build_times, main
from server.responses import ChoiceState, usage
from server.sampling_builder import derive_seed
from server.settings import ServerSettings

salts = st.one_of(st.none(), st.text(max_size=12))


@given(st.text(max_size=12), salts, st.text(max_size=12), salts)
def test_tenant_salt_is_injective(key_a: str, salt_a, key_b: str, salt_b) -> None:
    same_tenant = key_a == key_b and (salt_a or "") == (salt_b or "")
    assert (tenant_salt(key_a, salt_a) == tenant_salt(key_b, salt_b)) == same_tenant


def test_default_tenant_is_empty_and_keys_hide_themselves() -> None:
    assert tenant_salt("", None) == ""
    assert "secret" not in key_salt("secret")
    assert key_salt("a") != key_salt("b")


def test_derived_seeds() -> None:
    assert derive_seed(42, 0) == 42
    seeds = [derive_seed(42, i) for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**63 or i == 0 for i, s in enumerate(seeds))
    assert derive_seed(-1, 0) == 2**64 - 1
    assert derive_seed(42, 3) == derive_seed(42, 3) != derive_seed(43, 3)


def test_delta_holds_back_half_characters() -> None:
    choice = ChoiceState(index=0, prompt_index=0, num_prompt_tokens=3)
    choice.text = "ab\ufffd"
    assert choice.take_delta(final=False) == "ab"
    choice.text = "abc\u00e9"
    assert choice.take_delta(final=False) == "c\u00e9"
    assert choice.take_delta(final=True) == ""


def test_usage_counts_each_prompt_once() -> None:
    choices = []
    for index, (prompt_index, cached) in enumerate([(0, 32), (0, 48), (1, 16)]):
        c = ChoiceState(index=index, prompt_index=prompt_index, num_prompt_tokens=50 + index)
        c.num_tokens = 5
        c.num_cached_tokens = cached
        c.cached_tokens_by_tier = {"hbm": cached}
        choices.append(c)
    u = usage(choices)
    assert u["prompt_tokens"] == 50 + 52
    assert u["completion_tokens"] == 15
    assert u["total_tokens"] == 117
    assert u["prompt_tokens_details"]["cached_tokens"] == 48
    assert u["prompt_tokens_details"]["cached_tokens_by_tier"] == {
        "hbm": 48, "hbm_peer": 0, "dram": 0, "ssd": 0, "remote": 0}


def test_settings_validate_once() -> None:
    assert ServerSettings().max_in_flight(8) == 24
    assert ServerSettings(max_queue=0).max_in_flight(8) == 8
    with pytest.raises(ValueError):
        ServerSettings(max_queue=-1)
    with pytest.raises(ValueError):
        ServerSettings(api_keys=("",))
    with pytest.raises(TypeError):
        ServerSettings(api_keys="one-string")  # type: ignore[arg-type]


def test_kvengine_serve_switches_threads_within_half_a_millisecond(tmp_path) -> None:
    """``kvengine serve`` sets the interval before it loads the engine (here: a folder with no
    model, so it stops there), so the link thread and the client's reader get the GIL back
    from a busy step thread within it (benchmarks/lookup_gil.py: 10.7 ms lookups at Python's
    default 5 ms)."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 1
        assert sys.getswitchinterval() == pytest.approx(SERVE_SWITCH_INTERVAL_S)
        assert SERVE_SWITCH_INTERVAL_S <= 0.0005
    finally:
        sys.setswitchinterval(before)


def test_reserved_template_names_are_the_renderers_own_parameters() -> None:
    """chat_template_kwargs may not set what ``ChatTemplate.render`` fills itself."""
    params = inspect.signature(ChatTemplate.render).parameters.values()
    own = {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
    assert own == RESERVED_TEMPLATE_NAMES


def test_the_warm_up_line_says_where_its_time_went() -> None:
    builds = BuildLog()
    assert _build_times(builds.snapshot()) == "no builds"
    for seconds in (0.05, 0.07):
        builds.record(CUDA_GRAPH, ("prefill", 1, 16), seconds)
    builds.record(CUDNN_LOAD, ("split", True, 1, 5, 64), 0.004)
    builds.seal()
    builds.record(CUDNN_LOAD, ("split", True, 1, 9, 64), 0.5)  # after ready: not the warm-up's
    assert _build_times(builds.snapshot()) == "cuda_graph 2 in 0.12 s, cudnn_plan_load 1 in 0.00 s"
