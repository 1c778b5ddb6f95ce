"""The draft gate: plain rounds where drafting does not pay, chosen by measured throughput — and the
output stays AR's, token for token, whatever it chooses."""
import itertools


from drafttree.draft_gate import ContextGate, DraftGate, GateMemory
from drafttree.engine import Sequence, generate_ar
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, CostAwarePolicy, DFlashProposer
from spec_helpers import random_drafter_for
from spec_helpers import prompts, synthetic_cost_model


def run_gate(draft_rate: float, plain_rate: float, rounds: int = 200, memory: GateMemory | None = None) -> list[bool]:
    gate, choices = DraftGate(memory=memory), []
    for _ in range(rounds):
        d = gate.choose()
        choices.append(d)
        gate.observe(d, tokens=int(10 * (draft_rate if d else plain_rate)), ms=10.0)
    return choices


def test_gate_plays_the_faster_choice_and_probes_the_other():
    fast_draft = run_gate(draft_rate=2.5, plain_rate=1.0)
    fast_plain = run_gate(draft_rate=0.7, plain_rate=1.0)
    assert sum(fast_draft[20:]) / 180 > 0.85 and sum(fast_plain[20:]) / 180 < 0.15
    assert 0 < sum(fast_plain[20:])  # still probes drafting: the text may change
    assert fast_draft[:6] == [True] * 6 and fast_draft[6:12] == [False] * 6  # both measured first


def test_probes_that_change_nothing_come_less_often_and_a_change_is_still_found():
    gate, starts, prev = DraftGate(), [], None
    for i in range(600):
        rate = {True: 0.7, False: 1.0} if i < 400 else {True: 2.5, False: 1.0}  # the text changes at round 400
        d = gate.choose()
        if i >= 12 and d and prev is not True and i < 400:
            starts.append(i)  # a probe of drafting begins
        prev = d
        gate.observe(d, tokens=int(10 * rate[d]), ms=10.0)
        if i == 599:
            assert d  # after the change drafting is the faster choice again
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == gate.max_probe_every + gate.probe_rounds - 1, gaps
    assert len(starts) <= 6  # 24, 48, 96, 96, ... rounds apart, not every 27


def test_a_new_request_starts_from_what_earlier_requests_measured():
    """With a memory shared by requests, the second request skips the warm-up: it plays the faster choice
    from its first round, and still probes the other one."""
    memory = GateMemory()
    first = run_gate(draft_rate=0.7, plain_rate=1.0, rounds=60, memory=memory)
    assert first[:6] == [True] * 6  # nothing remembered yet: the warm-up as before
    second = run_gate(draft_rate=0.7, plain_rate=1.0, rounds=100, memory=memory)
    assert second[:20] == [False] * 20 and any(second)
    # and it follows its own rounds when they disagree with the memory
    third = run_gate(draft_rate=2.5, plain_rate=1.0, rounds=200, memory=memory)
    assert sum(third[100:]) / 100 > 0.85


def test_memory_is_trusted_only_after_enough_rounds():
    memory = GateMemory(min_rounds=6)
    run_gate(draft_rate=0.7, plain_rate=1.0, rounds=5, memory=memory)  # 5 drafted rounds: too few
    assert run_gate(draft_rate=0.7, plain_rate=1.0, rounds=12, memory=memory)[:6] == [True] * 6
    # drafting now known (5 + 6 rounds), plain rounds not yet: only their warm-up runs
    assert run_gate(draft_rate=0.7, plain_rate=1.0, rounds=12, memory=memory)[:6] == [False] * 6


def test_context_gate_learns_each_kind_of_round_apart():
    """Drafting pays in one kind of round and not in the other: each kind's gate learns its own choice,
    and a round's measurement goes to the gate that chose it."""
    gate, choices = ContextGate(), {False: [], True: []}
    rate = {(True, True): 2.5, (True, False): 1.0, (False, True): 0.7, (False, False): 1.0}  # (kind, drafted)
    for i in range(400):
        kind = i % 3 == 0
        gate.context = kind
        d = gate.choose()
        choices[kind].append(d)
        gate.context = not kind  # what the next round will be does not move this round's measurement
        gate.observe(d, tokens=int(10 * rate[kind, d]), ms=10.0)
    assert sum(choices[True][20:]) / len(choices[True][20:]) > 0.85
    assert sum(choices[False][20:]) / len(choices[False][20:]) < 0.15


class ScriptedGate(DraftGate):
    """Alternates runs of drafted and plain rounds, to exercise the drafter's catch-up."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.script = itertools.cycle([True, True, False, False, False, True, False])

    def choose(self, batch: int = 1) -> bool:
        return next(self.script)


def test_gated_speculation_equals_ar_and_the_drafter_catches_up(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    monkeypatch.setattr("drafttree.proposers.DraftGate", ScriptedGate)
    for policy in (BestFirstPolicy(6), CostAwarePolicy(synthetic_cost_model(), 32, recalibrate=True)):
        gated = DFlashProposer(drafter, target.model, policy, gate=True)
        for ids in prompts(3, target.model.config.vocab_size, seed=2):
            truth = generate_ar(target, ids, max_new_tokens=30, stop_token_ids=()).tokens
            seq = Sequence(target, ids, gated, 30, stop_token_ids=())
            sizes = []
            while not seq.done:
                seq.step()
                if seq.draft_state is not None and seq.stats.tree_sizes:
                    # every committed token is in the drafter's context or waits for its next draft, in order
                    st = seq.draft_state
                    pending = sum(f.shape[0] for f in st.deferred)
                    assert st.context.length + pending == seq.state.length
                    assert not st.deferred or st.deferred_start == st.context.length
                    if seq.stats.tree_sizes[-1] > 0:  # a drafted round: the context was up to date when it drafted
                        assert pending == seq.stats.accept_lengths[-1]
                sizes = seq.stats.tree_sizes
            assert seq.tokens == truth
            assert 0 in sizes and max(sizes) > 0  # both kinds of rounds ran


def test_in_a_batched_turn_drafting_must_beat_the_batch_rate():
    """Alone the gate compares tokens per ms; in a turn of 8 requests a drafted round's extra time is everyone's,
    so drafting pays only when its extra tokens per extra ms beat about 8x the request's plain rate."""
    gate = DraftGate()
    for _ in range(10):
        gate.observe(True, 2, 14.0)  # drafted: 2 tokens in a 14 ms turn
        gate.observe(False, 1, 10.0)  # plain: 1 token in a 10 ms turn
    assert gate.drafting_pays() and gate.drafting_pays(batch=1)  # 0.143 > 0.1 tokens/ms
    assert gate.drafting_pays(batch=2)  # 1 extra token per 4 extra ms = 0.25 >= 2 x 0.1
    assert not gate.drafting_pays(batch=8)  # 0.25 < 8 x 0.1
    assert gate.choose(batch=1) and not gate.choose(batch=8)
    cheap = DraftGate()
    for _ in range(10):
        cheap.observe(True, 3, 10.0)  # drafting costs nothing extra: it pays at any batch
        cheap.observe(False, 1, 10.0)
    assert cheap.drafting_pays(batch=32)


def test_a_seeded_gate_weighs_its_memory_as_rounds():
    memory = GateMemory()
    for _ in range(10):
        memory.observe(True, 2, 14.0)
        memory.observe(False, 1, 10.0)
    gate = DraftGate(memory=memory)
    assert gate._weight == {True: memory.seed_rounds, False: memory.seed_rounds}
    assert gate.drafting_pays(batch=1) and not gate.drafting_pays(batch=8)
