"""The world model's checks: mean ranks of facts and implications before and after finetuning,
where finetuning stores the new facts, and where the second hop's bridge reaches the last token."""

from __future__ import annotations

from typing import Any

from extractive_lens.world.data import ROLES, World, build_world, first_hop, second_hop
from extractive_lens.world.model import finetune_recipes, world_info, world_of


def finetune_check(model: Any, seed: int = 0, world_seed: int | None = None) -> dict[str, float]:
    """Finetune on the 20 first-hop and 20 second-hop test facts (the world's recipe,
    ``finetune_recipes``) and return the mean ranks of facts and implications before and after
    (chance 9.5)."""
    from extractive_lens.finetuning import FinetuneConfig, finetune, mean_rank

    if world_seed is None and world_info(model):
        w = world_of(model)
    else:
        w = build_world(0 if world_seed is None else world_seed)
    out = {}
    for name, ds in (("first_hop", first_hop(w)), ("second_hop", second_hop(w))):
        facts, impls = ds.batches(model)
        out[f"{name} facts before"] = mean_rank(model, facts)
        out[f"{name} implications before"] = mean_rank(model, impls)
        cfg = FinetuneConfig(**finetune_recipes(w.version)[0], seed=seed)
        diff = finetune(model, facts, cfg, show_progress=False)
        out[f"{name} facts after"] = mean_rank(model, facts, diff)
        out[f"{name} implications after"] = mean_rank(model, impls, diff)
    return out


def informative_by_hop(
    model: Any, seed: int = 0, *, blocks_only: bool = False, world: World | None = None
) -> dict[str, Any]:
    """Finetune on each hop's 20 test facts (the world's recipe; ``blocks_only``: embeddings
    and unembedding frozen, as in the paper's OLMo runs) and score the implications' linear
    informative scores: ``{"first_hop": ScoreResult, "second_hop": ScoreResult}``. ``world``:
    default, the model's own (``world_of``)."""
    import warnings

    from extractive_lens.finetuning import FinetuneConfig, finetune
    from extractive_lens.scoring.linear import AdditivityWarning, linear_scores

    w = world or (world_of(model) if world_info(model) else build_world(0))
    layers = tuple(range(model.cfg.n_layers)) if blocks_only else None
    out = {}
    for name, ds in (("first_hop", first_hop(w)), ("second_hop", second_hop(w))):
        facts, impls = ds.batches(model)
        cfg = FinetuneConfig(**finetune_recipes(w.version)[0], seed=seed, layers=layers)
        diff = finetune(model, facts, cfg, show_progress=False)
        with warnings.catch_warnings():  # locations, not the linear-vs-exact gap, are asked here
            warnings.simplefilter("ignore", AdditivityWarning)
            out[name] = linear_scores(
                model, diff, impls, kinds=("informative",), show_progress=False
            )
    return out


def informative_pattern(
    model: Any, seed: int = 0, *, blocks_only: bool = False, world: World | None = None
) -> dict[str, float]:
    """Where finetuning stores the new facts, as the paper's Fig. 5 reads it
    (``informative_by_hop``): the share of the MLPs' |linear informative mass| on the
    implications at the slot tokens (first hop: the person's name; second hop: the landmark) and
    the MLP mass per layer. The paper: first hop at the name, second hop at the last token."""
    out = {}
    for name, lin in informative_by_hop(model, seed, blocks_only=blocks_only, world=world).items():
        mlp = lin["informative"][:, lin.component_labels.index("MLP"), :].abs()  # (layer, pos)
        slots = [i for i, p in enumerate(lin.position_labels) if p.startswith("{")]
        out[f"{name} MLP share at the slot"] = float(mlp[:, slots].sum() / mlp.sum())
        out[f"{name} MLP share at the last token"] = float(mlp[:, -1].sum() / mlp.sum())
        for layer, share in enumerate((mlp.sum(1) / mlp.sum()).tolist()):
            out[f"{name} MLP share in layer {layer}"] = share
    return out


def bridge_arrival(model: Any, world: World | None = None) -> list[float]:
    """Where the second hop's bridge (the city) reaches the last token: one share per stage,
    after the embeddings and after each block.

    For every city, the residual stream at the last token of the implication prompt ``"The
    {role} of the city that contains {landmark} is"`` is compared with that of the fact prompt
    ``"The {role} of {city} is"`` (both centred over the cities, cosine similarity); the share is
    the fraction of implication prompts whose nearest fact prompt is their own city's (chance: one
    over the number of cities), over every role and both landmarks. A block's finetuned update
    can serve the implication only from the stage where the implication already holds the city
    as the fact does: in the paper that is the middle layers, so the second hop needs the late
    ones; in the bundled worlds it is block 0. ``world``: default, the model's own."""
    import torch

    from extractive_lens import backend as B
    from extractive_lens.backend.blocks import run_blocks

    w = world or (world_of(model) if world_info(model) else build_world(0))

    def last_token(prompts: list[str]) -> torch.Tensor:  # [stage, prompt, d_model]
        rows = []
        with torch.no_grad():
            for prompt in prompts:  # one at a time: no padding to mind
                x = B.embed(model, model.to_tokens(prompt))
                stages = [x[0, -1]]
                run_blocks(model, x, observe=lambda run: stages.append(run.post[0, -1]))
                rows.append(torch.stack([s.cpu().float() for s in stages]))
        return torch.stack(rows, dim=1)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(x - x.mean(1, keepdim=True), dim=-1)

    own = torch.arange(len(w.cities))
    shares = []
    for role in ROLES:
        fact = unit(last_token([f"The {role} of {c} is" for c in w.cities]))
        for k in range(2):
            implication = unit(
                last_token(
                    [
                        f"The {role} of the city that contains {w.landmarks[c][k]} is"
                        for c in w.cities
                    ]
                )
            )
            nearest = (implication @ fact.transpose(1, 2)).argmax(-1)  # [stage, implication]
            shares.append((nearest == own).float().mean(-1))
    return torch.stack(shares).mean(0).tolist()
