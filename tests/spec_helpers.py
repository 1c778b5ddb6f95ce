"""Proposers and helpers for testing speculative decoding on tiny models."""
import torch

from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.drafter.model import DFlashConfig, DFlashDrafter
from drafttree.proposers import DraftsOneByOne
from drafttree.load import load_target
from drafttree.weaver import Weaver, WeaverConfig


class TargetCopyProposer(DraftsOneByOne):
    """Drafts with a second copy of the target (plus optional noise): high acceptance, so the tests
    exercise deep accepted paths, partial acceptance and rejection in every round."""

    capture_layers = ()

    def __init__(self, checkpoint, policy, noise: float = 0.0, seed: int = 0, depth: int = 6):
        self.copy = load_target(str(checkpoint)).model
        self.policy, self.noise, self.depth = policy, noise, depth
        self.max_nodes = policy.max_nodes(depth)
        self.name = policy.name
        self.gen = torch.Generator().manual_seed(seed)

    def begin(self, prompt_ids, prompt_features, clock=None):
        state = {"copy": self.copy.new_state(512), "policy": self.policy.new_state(clock)}
        self.copy.prefill(state["copy"], prompt_ids)
        return state

    def draft(self, state, root, start):
        rows, tok, st = [], torch.tensor([root]), state["copy"]
        for _ in range(self.depth):
            logits = self.copy.forward(st, tok).logits[0]
            self.copy.commit(st, torch.tensor([0]))
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.gen)
            rows.append(logits)
            tok = logits.argmax().view(1)
        st.kv.truncate(start)
        return torch.stack(rows)

    def build_tree(self, state, root, logits, start):
        return self.policy.build(state["policy"], root, logits, start)

    def advance(self, state, tokens, features, start):
        self.policy.record_acceptance(state["policy"], tokens.numel() - 1)
        self.copy.forward(state["copy"], tokens)
        self.copy.commit(state["copy"], torch.arange(tokens.numel()))


def random_drafter_for(model, layers=2, block_size=8, seed=0) -> DFlashDrafter:
    cfg = model.config
    torch.manual_seed(seed)
    d = DFlashDrafter(DFlashConfig(hidden_size=cfg.hidden_size, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=cfg.vocab_size, target_layer_ids=[0, cfg.num_layers - 1],
                                   num_target_layers=cfg.num_layers, block_size=block_size,
                                   rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings))
    d.reset_parameters(std=0.5)
    return d.eval()


def synthetic_cost_model(draft_ms: float = 3.0) -> VerifyCostModel:
    """A cost model the tests share: convex in the verified tokens, flat-ish first, then linear."""
    return VerifyCostModel(context_lens=(0,), curves=(ConvexCost(knots=(1.0, 8.0, 64.0), values=(10.0, 12.0, 40.0)),),
                           draft_ms=draft_ms)


def weaver_for(target, drafter, trained: bool = True, seed: int = 0, k: int = 16) -> Weaver:
    """A small random Weaver for `drafter` (trained: a readout that changes the trees)."""
    torch.manual_seed(seed)
    w = Weaver(WeaverConfig(vocab_size=target.model.config.vocab_size, embed_size=target.model.config.hidden_size,
                            drafter_hidden_size=drafter.config.hidden_size, max_depth=drafter.config.block_size - 1,
                            hidden_size=32, num_layers=1, num_heads=4, intermediate_size=48, num_candidates=k)).eval()
    if trained:  # a residual that changes the trees
        with torch.no_grad():
            w.readout.weight.normal_(0, 0.5)
    return w


def prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


def cpu_like_cost_model() -> VerifyCostModel:
    # the shape measured on these machines (tokens -> ms); a fixed model keeps the test deterministic
    curve = ConvexCost(knots=(1.0, 8.0, 32.0, 128.0), values=(30.0, 36.0, 66.0, 200.0))
    return VerifyCostModel(context_lens=(0,), curves=(curve,), draft_ms=8.0)


# synthetic cost models that push the policies and gates into their corners (a drafter dearer than a verify, a
# verify that barely grows, one that grows steeply)
REGIMES = {
    "cheap-draft": VerifyCostModel(context_lens=(0,), curves=(ConvexCost((1.0, 8.0, 64.0), (10.0, 12.0, 40.0)),),
                                   draft_ms=1.0),
    "dear-draft": VerifyCostModel(context_lens=(0,), curves=(ConvexCost((1.0, 8.0, 64.0), (10.0, 12.0, 40.0)),),
                                  draft_ms=30.0),
    "steep-verify": VerifyCostModel(context_lens=(0, 64), curves=(ConvexCost((1.0, 2.0, 64.0), (3.0, 9.0, 400.0)),
                                                                  ConvexCost((1.0, 2.0, 64.0), (4.0, 12.0, 600.0))),
                                    draft_ms=2.0, draft_ms_per_context_token=0.01),
}


def repetitive_prompts(vocab: int, n: int, seed: int) -> list[torch.Tensor]:
    """Random prompts of 1-30 tokens, every other one a repeated phrase (the lookup's matches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 31, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        if i % 2:
            ids = ids[: max(1, length // 4)].repeat(4)[:length]
        out.append(ids)
    return out


def assert_every_method_equals_ar(target, decoder, ids: torch.Tensor, max_new: int, context: str) -> None:
    """Every speculative method's greedy reply to `ids` through `decoder` equals AR's, token for token."""
    from drafttree.engine import generate_ar
    from drafttree.methods import METHODS

    ar = generate_ar(target, ids, max_new, stop_token_ids=()).tokens
    for method in METHODS[1:]:
        seq = decoder.sequence(method, ids, max_new_tokens=max_new, stop_token_ids=())
        while not seq.done:
            seq.step()
        assert seq.tokens == ar, (method, context, ids.tolist(), max_new)
