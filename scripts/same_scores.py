"""Are two checkouts' scores bit-identical? Linear (both conventions) and exact (per token, per
component, resample) scores on the world model, and on float64 tiny parallel / attention-only /
rotary-GQA models, computed by each tree in its own process.

    python scripts/same_scores.py /tmp/el_before out_old.pt && python scripts/same_scores.py . out_new.pt
    python scripts/same_scores.py --compare out_old.pt out_new.pt
"""

import copy
import sys
import warnings

if sys.argv[1] == "--compare":
    import torch

    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    for k in a:
        same = torch.equal(a[k], b[k])
        print(
            k,
            tuple(a[k].shape),
            "bit-identical" if same else f"max diff {float((a[k] - b[k]).abs().max()):.3e}",
        )
    sys.exit(0)
tree, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
warnings.filterwarnings("ignore")
import torch  # noqa: E402

from extractive_lens import WeightDiff, causal_scores, linear_scores, tiny_model  # noqa: E402
from extractive_lens.world import first_hop, load_world_model  # noqa: E402

base = load_world_model()
ft = copy.deepcopy(base)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in ft.parameters():
        p.add_(1e-2 * p.abs().mean() * torch.randn(p.shape, generator=g))
diff = WeightDiff.from_models(base, ft)
_, impls = first_hop().batches(base)
b = impls.subset(range(6))
res = {}
for conv in ("paper", "authors_code"):
    s = linear_scores(base, diff, b, convention=conv, batch_size=4)
    res[f"lin_{conv}"] = s.prompt_values
    res[f"lin_{conv}_other"] = s.other
res["causal_tok"] = causal_scores(base, diff, b, batch_size=4, max_batch=50).prompt_values
res["causal_comp"] = causal_scores(base, diff, b, per="component").prompt_totals
res["causal_resample"] = causal_scores(
    base, diff, b, kinds="upstream", ablation="resample", resample_k=3
).prompt_values
# parallel + attn-only + rotary GQA tiny models, float64
for name, cfg in {
    "par": dict(parallel_attn_mlp=True, positional_embedding_type="rotary", rotary_dim=4),
    "attnonly": dict(attn_only=True),
    "gqa": dict(
        normalization_type="RMS",
        gated_mlp=True,
        act_fn="silu",
        positional_embedding_type="rotary",
        rotary_dim=8,
        n_key_value_heads=2,
    ),
}.items():
    cfg = dict(cfg, dtype=torch.float64, n_layers=3)
    m0, m1 = tiny_model(cfg, seed=0), tiny_model(cfg, seed=1)
    with torch.no_grad():
        for p, q in zip(m1.parameters(), m0.parameters()):
            p.copy_(q + 0.05 * (p - q))
    d = WeightDiff.from_models(m0, m1)
    toks = torch.randint(3, 50, (5, 7), generator=torch.Generator().manual_seed(2))
    from extractive_lens.batch import PromptBatch

    bb = PromptBatch(
        tokens=toks[:, :6],
        lengths=torch.full((5,), 6),
        prompt_lengths=torch.full((5,), 6),
        answer_targets=toks[:, 6:7],
        candidates=None,
        counterfactual=None,
        roles=tuple(tuple(f"p{i}" for i in range(6)) for _ in range(5)),
        prompts=tuple("x" for _ in range(5)),
        answers=tuple("y" for _ in range(5)),
    )
    res[f"{name}_lin"] = linear_scores(m0, d, bb, upstream_group=1).prompt_values
    res[f"{name}_lin_all"] = linear_scores(m0, d, bb, upstream_group=None).prompt_values
    res[f"{name}_cau"] = causal_scores(m0, d, bb).prompt_values
torch.save(res, out)
