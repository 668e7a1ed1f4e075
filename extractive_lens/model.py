"""Loading models, and the model API the rest of the package calls (``extractive_lens.backend``).

>>> base = tiny_model({"n_layers": 2}, seed=0)          # a seeded HookedTransformer
>>> ft = load_checkpoint("runs/finetuned")  # a local HF checkpoint  # doctest: +SKIP
>>> x = embed(base, torch.tensor([[1, 2, 3]]))          # the pieces of a forward pass
>>> out, captured = attention(base, 0, x, capture=("z", "pattern"))
>>> captured["pattern"].shape                           # batch head query_pos key_pos
torch.Size([1, 4, 3, 3])

Everything here is re-exported from ``extractive_lens.backend`` (the one package that knows
TransformerLens): ``parameter_slices`` (which component owns which parameter, docs/scores.md §2),
``embed`` / ``attention`` / ``mlp`` / ``unembed`` and ``run_blocks`` (so the scoring engines can
resume the residual stream at any layer boundary) and ``signature`` (what must match between a
base and a finetuned model); and ``locked`` (``extractive_lens.interrupts``: hold the model's
lock, the one scoring takes, around several calls of your own; TransformerLens's hook contexts,
``run_with_cache`` among them, take it by themselves: ``backend/hook_locks.py``).
"""

from __future__ import annotations

from extractive_lens.backend import (  # noqa: F401
    BACKENDS,
    W_O,
    LayerRun,
    ParamRole,
    ParamSlice,
    ScorableModel,
    attention,
    attn_out_names,
    backend_for,
    check_scorable,
    computing_in,
    describe,
    embed,
    frozen_parameters,
    has_mlp,
    hook_name,
    jvp,
    layer_of,
    mlp,
    mlp_input,
    notes,
    on_block,
    on_final,
    parallel,
    param_role,
    parameter_slices,
    parameters,
    resolve_compute_dtype,
    run_blocks,
    signature,
    slices_for_names,
    standard_flags,
    unembed,
    weights_processed,
)
from extractive_lens.backend.building import as_bridge  # noqa: F401
from extractive_lens.backend.families import ARCHITECTURES, hf_config_to_tl  # noqa: F401
from extractive_lens.backend.hooked import VIEW_FLAGS  # noqa: F401
from extractive_lens.backend.in_memory import from_hf  # noqa: F401
from extractive_lens.backend.installed import BACKEND_NAMES, resolve_backend  # noqa: F401
from extractive_lens.backend.loading import (  # noqa: F401
    NO_PROCESSING,
    load_checkpoint,
    load_hf_pretrained,
    load_pretrained,
)
from extractive_lens.backend.tiny import tiny_model  # noqa: F401
from extractive_lens.backend.tokenizer import (  # noqa: F401
    named_tokenizer,
    tokenizer_prepends_bos,
    word_tokenizer,
)
from extractive_lens.interrupts import locked  # noqa: F401, E402
