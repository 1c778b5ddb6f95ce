"""The runtime and AR decoding on the real embedded model (fp32) against transformers."""
import torch

from runtime_helpers import check_against_reference


def test_logits_match_transformers(smollm2):
    target, ref = smollm2
    prompt = target.encode_chat("Name three primary colors.")
    check_against_reference(target, ref, prompt, atol=1e-4, n_tree=8)


def test_ar_greedy_equals_transformers_generate(smollm2, ar_outputs):
    """Literally generate() on two prompts; on all 20, transformers' greedy choice at every step
    (one teacher-forced forward over prompt + our reply) equals our token — the same condition
    generate(do_sample=False) checks step by step, at a fraction of the cost."""
    target, ref = smollm2
    for ids, ours in ar_outputs[:2]:
        with torch.no_grad():
            theirs = ref.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                                  max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=2)[0, ids.numel():]
        assert ours == theirs.tolist()
    for ids, ours in ar_outputs:
        seq = torch.cat([ids, torch.tensor(ours[:-1])])
        with torch.no_grad():
            choice = ref(seq[None]).logits[0, ids.numel() - 1:].argmax(-1)
        assert choice.tolist() == ours
