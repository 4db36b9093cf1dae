"""kv-canary inside a real vLLM engine: clean runs stay silent, each fault in vLLM's own structures is
named with its reason and launch point, and each policy does what it promises.

Each engine runs in a process of its own (``remote``): a fault-free reference without the canary,
and one engine per policy. Greedy decoding throughout, so a fault-free run's tokens are the truth.
"""

from __future__ import annotations

import pytest

from .remote import Remote

BLOCK = 32


@pytest.fixture(scope="module")
def engines(tiny_llama):
    made = {}

    def get(policy: str) -> Remote:
        if policy not in made:
            made[policy] = Remote(tiny_llama, policy)
        return made[policy]

    yield get
    for remote in made.values():
        remote.close()


def _slots(block: int) -> set[int]:
    return set(range(block * BLOCK, (block + 1) * BLOCK))


def _tokens(result: dict) -> dict[str, list[int]]:
    return {name: out["tokens"] for name, out in result["outputs"].items()}


def test_clean_runs_report_nothing_and_change_no_token(engines):
    reference = engines("off").call("clean")
    for policy in ("log", "recompute"):
        run = engines(policy).call("clean")
        assert run["violations"] == [], run["violations"][:3]
        assert _tokens(run) == _tokens(reference)
        assert run["prompt_len"] > 96  # longer than a step's token budget: chunked prefill
        assert run["prefix_hits"] >= 4  # the shared prompts hit the prefix cache
        assert run["preemptions"] >= 1  # more KV than the cache holds
        assert all(out["finish_reason"] == "length" for out in run["outputs"].values())


def test_repointed_block_table_entry_is_named_at_head(engines):
    log = engines("log")
    run = log.call("repoint")
    fired, violations = run["fired"], run["violations"]
    assert violations, "the repointed entry went unseen"
    wrong = _slots(fired["other_block"])
    first = violations[0]
    assert (first["point"], first["reasons"], first["slot"], first["step"]) == \
        ("HEAD", ["verify_token"], min(wrong) + first["position"], fired["step"])
    assert fired["request"] in first["requests"]
    for v in violations:
        assert v["step"] == fired["step"] and v["point"] in ("HEAD", "TAIL") and v["pool"] == "FULL"
        if v["slot"] in wrong:  # another request's tokens where this one's should be
            assert v["reasons"] == ["verify_token"] and v["position"] == v["slot"] - min(wrong)
        else:  # the request's own next block: its predecessor is now the wrong block's last slot
            assert (v["slot"], v["reasons"], v["position"]) == (fired["second_block"] * BLOCK, ["chain"], BLOCK)
    assert {v["point"] for v in violations} == {"HEAD", "TAIL"}
    assert log.call("repoint", fault=False)["violations"] == []


def test_dropped_kv_write_is_named_at_tail(engines):
    log = engines("log")
    run = log.call("dropped_write")
    fired, violations = run["fired"], run["violations"]
    first = violations[0]
    assert (first["point"], first["reasons"], first["slot"], first["position"], first["step"]) == \
        ("TAIL", ["missed_write"], fired["slot"], fired["position"], fired["step"])
    assert first["requests"] == [fired["request"]]
    # under log the damage stays where it is: every later read names the same slot, by its fingerprint
    assert {(v["slot"], v["point"], tuple(v["reasons"])) for v in violations[1:]} <= {(fired["slot"], "TAIL",
                                                                                      ("fingerprint",))}
    assert log.call("dropped_write", fault=False)["violations"] == []


def test_flipped_byte_in_a_cached_block_is_named_by_the_hit_that_reads_it(engines):
    log = engines("log")
    run = log.call("flip_cached")
    slot = run["fired"]["slot"]
    assert run["violations"]
    for v in run["violations"]:
        assert (v["point"], v["reasons"], v["slot"], v["position"]) == ("TAIL", ["fingerprint"], slot, 5)
        assert len(v["requests"]) == 1 and v["requests"][0].startswith("again#")
    assert log.call("flip_cached", fault=False)["violations"] == []


def test_flipped_byte_in_an_idle_cached_block_is_swept_and_never_served(engines):
    log = engines("log")
    run = log.call("flip_cached", wait_for_sweep=True)
    [v] = run["violations"]  # found once, by a sweep; the block left the cache, so no request read it
    assert (v["point"], v["reasons"], v["slot"], v["requests"]) == ("SWEEP", ["fingerprint"], run["fired"]["slot"],
                                                                    ["cache"])
    assert run["outputs"]["again"]["tokens"] == run["outputs"]["first"]["tokens"]  # recomputed, not served
    assert log.call("flip_cached", fault=False, wait_for_sweep=True)["violations"] == []


def test_block_handed_out_while_still_read_is_named_at_head(engines):
    log = engines("log")
    run = log.call("freed_reused")
    fired, violations = run["fired"], run["violations"]
    first = violations[0]
    assert (first["point"], first["reasons"], first["step"]) == ("HEAD", ["read_conflict"], fired["step"])
    assert first["slot"] in _slots(fired["block"])
    assert {fired["victim"], fired["writer"]} <= set(first["requests"])
    assert log.call("freed_reused", fault=False)["violations"] == []


def test_prefix_hit_on_the_wrong_block_is_named_at_head(engines):
    log = engines("log")
    run = log.call("hash_collision")
    fired, violations = run["fired"], run["violations"]
    wrong = _slots(fired["y_block"])
    head = [v for v in violations if v["point"] == "HEAD"]
    assert head and head[0]["slot"] in wrong and "verify_token" in head[0]["reasons"]
    assert all(v["requests"] == [v["requests"][0]] and v["requests"][0].startswith("hit#") for v in violations)
    # and the hit's second block, the first prompt's own: its first slot's predecessor is the wrong block's last
    assert {v["slot"] for v in violations} <= wrong | {fired["x_second"] * BLOCK}
    assert log.call("hash_collision", fault=False)["violations"] == []


@pytest.mark.parametrize("fault", ["repoint", "dropped_write", "flip_cached", "hash_collision"])
def test_recompute_delivers_exactly_the_fault_free_tokens(engines, fault):
    recompute = engines("recompute")
    clean = recompute.call(fault, fault=False)
    run = recompute.call(fault)
    assert run["violations"], f"{fault}: nothing detected"
    assert _tokens(run) == _tokens(clean)
    assert all(out["finish_reason"] == "length" for out in run["outputs"].values())


def test_raise_fails_the_readers_and_serves_the_rest(engines):
    raising = engines("raise")
    clean = raising.call("freed_reused", fault=False)
    run = raising.call("freed_reused")
    outputs = run["outputs"]
    assert outputs["early"]["finish_reason"] == "error"  # it read the block another request wrote
    for name in ("late", "bystander"):
        assert outputs[name] == clean["outputs"][name]
    repoint_clean = raising.call("repoint", fault=False)
    repointed = raising.call("repoint")
    victim = repointed["fired"]["request"].split("#")[0]
    other = "b" if victim == "a" else "a"
    assert repointed["outputs"][victim]["finish_reason"] == "error"
    assert repointed["outputs"][other] == repoint_clean["outputs"][other]  # its block was read, not damaged


def test_sliding_window_model_is_covered_over_its_window(tiny_mistral):
    """vLLM keeps a model whose every layer slides as one sliding-window group; the canary verifies
    each forward's window (blocks out of it are freed and handed out again) and finds a flip in it."""
    remote = Remote(tiny_mistral, "log")
    try:
        clean = remote.call("window_flip", fault=False)
        run = remote.call("window_flip")
    finally:
        remote.close()
    assert clean["violations"] == [] and clean["fired"]["window"] == 64
    fired = run["fired"]
    first = run["violations"][0]
    assert (first["point"], first["pool"], first["reasons"], first["slot"], first["position"], first["step"]) == \
        ("TAIL", "SWA", ["fingerprint"], fired["slot"], fired["position"], fired["step"])
    assert fired["request"] in first["requests"]
