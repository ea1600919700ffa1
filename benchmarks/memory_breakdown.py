"""Where a real-size trainer's memory goes: resident memory after each phase, and the bytes each
component holds (the user's module, the engine's flat buffers, graph protos kept alive).

Run: ``python benchmarks/memory_breakdown.py --model gpt2 --batch 4 --seq 128`` (Hugging Face
``transformers``, random weights: GPT-2 small, 124 M weights, or ``bert``: BERT-base MLM, 110 M).
Eager PyTorch (AdamW, clipping) runs the same steps in its own process with ``--eager``. Prints
one JSON object: the phases' resident memory (current and peak, MB) and the components' sizes (MB).
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MB."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    current = int(fields["VmRSS"].split()[0]) / 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _workload(name: str, batch: int, seq: int):
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_positions=max(seq, 128), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         loss_type="ForCausalLM", use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        inputs = (ids, torch.ones_like(ids), ids)
        desc = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
                           ("labels", ["batch", "seq"])],
                "outputs": [("loss", [], True), ("logits", ["batch", "seq", config.vocab_size])]}
    else:
        config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(config)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        labels = torch.where(torch.rand(batch, seq) < 0.15, ids, torch.full_like(ids, -100))
        inputs = (ids, torch.ones_like(ids), labels)
        desc = {"inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]),
                           ("labels", ["batch", "seq"])],
                "outputs": [("loss", [], True), ("logits", ["batch", "seq", config.vocab_size])]}
    return model, desc, inputs


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="eager PyTorch + AdamW instead of ort_trainer")
    args = parser.parse_args()

    import torch

    phases = {"imported": _rss_mb()}
    model, desc, inputs = _workload(args.model, args.batch, args.seq)
    phases["model built"] = _rss_mb()
    mb = 2.0 ** 20
    components = {"module weights and buffers": _unique_bytes([*model.parameters(), *model.buffers()]) / mb}
    seconds = []
    if args.eager:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=inputs[0], attention_mask=inputs[1], labels=inputs[2]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            seconds.append(time.perf_counter() - started)
            phases[f"step {step + 1}"] = _rss_mb()
    else:
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import AdamConfig

        trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4))
        trainer._train_step_info.fetches = ["loss"]
        phases["trainer constructed"] = _rss_mb()
        for step in range(args.steps):
            started = time.perf_counter()
            trainer.train_step(*inputs)
            seconds.append(time.perf_counter() - started)
            phases[f"step {step + 1}"] = _rss_mb()
        engine = trainer._engine
        module = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        flat = [*engine.weights_flat, engine.grads_flat, engine.accumulated_flat,
                *(t for parity in engine.states_flat for t in parity.values())]
        components.update({
            "engine weights (flat)": _unique_bytes(engine.weights_flat) / mb,
            "engine gradients (flat)": _unique_bytes([engine.grads_flat, engine.accumulated_flat]) / mb,
            "engine optimizer states (flat)": _unique_bytes([t for p in engine.states_flat for t in p.values()]) / mb,
            "engine fixed tensors (frozen weights, buffers)": _unique_bytes(list(engine.fixed_tensors.values())) / mb,
            "module storage shared with the engine": sum(
                t.untyped_storage().nbytes() for t in flat if t.untyped_storage().data_ptr() in module) / mb,
            "gradient graph proto": trainer._graphs.gradient.ByteSize() / mb,
        })
    report = {"model": args.model, "implementation": "eager" if args.eager else "ort_trainer",
              "batch": args.batch, "seq": args.seq,
              "weights": sum(p.numel() for p in model.parameters()),
              "phases_mb": {k: {"rss": round(v[0]), "peak": round(v[1])} for k, v in phases.items()},
              "components_mb": {k: round(v) for k, v in components.items()},
              "step_seconds": [round(s, 3) for s in seconds]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
