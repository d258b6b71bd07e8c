"""Multi-LoRA throughput: a batch spread over 4 adapters against the base model alone: `python -m benchmarks.lora`.

Random PEFT adapters (ranks 8, 12, 16, 16 on all seven projections, written here as PEFT saves them)
for the model at `--model`. Two engines in one process: the base model without LoRA, and the same
model with enable_lora (max_loras=4, max_lora_rank=16). Decode-heavy requests (short random prompts,
`--output-len` tokens each, EOS ignored) at each `--num-seqs`: output tokens/s of the base engine, of
the LoRA engine with every request on the base model, and of the LoRA engine with the requests spread
over the 4 adapters in turn. The engines alternate round by round (load from other processes falls on
all alike); the median round is reported. A resident adapter's cost is stated as the bytes of one
slot and the multiply-adds it adds to every token (every token reads every slot).

`--delta-forms`: instead, the batched update of one fused q/k/v projection (the model's shapes, 4 slots
of rank 16, tokens in random slots) timed in the engine's form (`lora_delta`: one-hot masked dots)
against grouped matmuls over the tokens sorted by slot (`jax.lax.ragged_dot`), beside the base dot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from cbjax import LLM, LoRARequest, SamplingParams
from cbjax.bench.common import print_table, write_json
from cbjax.models.layers.lora import lora_delta

RANKS = [8, 12, 16, 16]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def projection_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """PEFT target -> (module path in a layer, in, out) from an HF config.json."""
    hidden, inner, head_dim = config["hidden_size"], config["intermediate_size"], config.get("head_dim")
    head_dim = head_dim or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": ("self_attn.q_proj", hidden, q), "k_proj": ("self_attn.k_proj", hidden, kv),
            "v_proj": ("self_attn.v_proj", hidden, kv), "o_proj": ("self_attn.o_proj", q, hidden),
            "gate_proj": ("mlp.gate_proj", hidden, inner), "up_proj": ("mlp.up_proj", hidden, inner),
            "down_proj": ("mlp.down_proj", inner, hidden)}


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> None:
    """A random rank-`rank` adapter on every projection, in PEFT's files."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, fan_in, fan_out in projection_shapes(config).values():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.01, (fan_out, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}))


def output_tokens_per_s(llm: LLM, num_seqs: int, output_len: int, prompt_len: int, seed: int,
                        adapters: list[LoRARequest | None]) -> float:
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(100, 10_000, size=prompt_len).tolist()} for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    lora = [adapters[i % len(adapters)] for i in range(num_seqs)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def ragged_delta(x: jax.Array, a: jax.Array, bs: list[jax.Array], token_slots: jax.Array) -> jax.Array:
    """lora_delta's value by grouped matmuls: tokens sorted by slot, slot 0 a group of zero factors."""
    num_parts, num_slots, rank, fan_in = a.shape
    order = jnp.argsort(token_slots)
    sizes = jnp.bincount(token_slots, length=num_slots + 1).astype(jnp.int32)
    a_groups = jnp.concatenate([jnp.zeros((1, fan_in, num_parts * rank), a.dtype),
                                a.transpose(1, 3, 0, 2).reshape(num_slots, fan_in, num_parts * rank)])
    xa = jax.lax.ragged_dot(x[order], a_groups, sizes)
    parts = [jax.lax.ragged_dot(xa[:, j * rank:(j + 1) * rank], jnp.concatenate([jnp.zeros_like(b[:1]), b]), sizes)
             for j, b in enumerate(bs)]
    return jnp.zeros((x.shape[0], sum(b.shape[-1] for b in bs)), x.dtype).at[order].set(jnp.concatenate(parts, -1))


def time_delta_forms(config: dict, token_counts: list[int], num_slots: int = 4, rank: int = 16) -> list[dict]:
    """Median microseconds of the base q/k/v dot and of each form of its LoRA update, per token count."""
    shapes = projection_shapes(config)
    fan_in, widths = shapes["q_proj"][1], [shapes[name][2] for name in ("q_proj", "k_proj", "v_proj")]
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(len(widths), num_slots, rank, fan_in)), jnp.float32)
    bs = [jnp.asarray(rng.normal(size=(num_slots, rank, width)), jnp.float32) for width in widths]
    kernel = jnp.asarray(rng.normal(size=(fan_in, sum(widths))), jnp.float32)
    forms = {"base dot": jax.jit(lambda x, a, bs, slots: x @ kernel), "one-hot (lora_delta)": jax.jit(lora_delta),
             "ragged_dot": jax.jit(ragged_delta)}
    rows = []
    for num_tokens in token_counts:
        x = jnp.asarray(rng.normal(size=(num_tokens, fan_in)), jnp.float32)
        slots = jnp.asarray(rng.integers(0, num_slots + 1, num_tokens), jnp.int32)
        np.testing.assert_allclose(forms["ragged_dot"](x, a, bs, slots), lora_delta(x, a, bs, slots), rtol=1e-4, atol=1e-3)
        for name, form in forms.items():
            form(x, a, bs, slots).block_until_ready()
            runs = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(20):
                    out = form(x, a, bs, slots)
                out.block_until_ready()
                runs.append((time.perf_counter() - start) / 20 * 1e6)
            rows.append({"tokens": num_tokens, "form": name, "us": statistics.median(runs)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per engine and batch size")
    p.add_argument("--delta-forms", action="store_true", help="time the update's forms on one projection instead")
    p.add_argument("--delta-tokens", type=int, nargs="+", default=[16, 64, 512], help="token counts of --delta-forms")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    config = json.loads((Path(args.model) / "config.json").read_text())
    if args.delta_forms:
        rows = time_delta_forms(config, args.delta_tokens)
        print_table(rows, ["tokens", "form", "us"])
        write_json(args.result_json, {"delta_forms": rows})
        return
    options = dict(max_num_seqs=max(args.num_seqs), max_model_len=args.prompt_len + args.output_len + 16,
                   max_num_batched_tokens=512)
    adapter_dir = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = []
    for index, rank in enumerate(RANKS):
        write_adapter(adapter_dir / f"adapter-{index}", config, rank, seed=index)
        adapters.append(LoRARequest(f"adapter-{index}", index + 1, str(adapter_dir / f"adapter-{index}")))
    engines = {}
    for name, lora in (("base", {}), ("lora", dict(enable_lora=True, max_loras=len(RANKS), max_lora_rank=max(RANKS)))):
        start = time.perf_counter()
        engines[name] = LLM(args.model, **lora, **options)
        print(f"{name}: engine built in {time.perf_counter() - start:.0f} s", flush=True)
    runs = {"base engine, base model": (engines["base"], [None]),
            "lora engine, base model": (engines["lora"], [None]),
            f"lora engine, {len(adapters)} adapters": (engines["lora"], adapters)}

    rows = []
    for num_seqs in args.num_seqs:
        rates = {name: [] for name in runs}
        for round_index in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
            for name, (llm, lora) in runs.items():
                rate = output_tokens_per_s(llm, num_seqs, args.output_len, args.prompt_len, round_index, lora)
                if round_index:
                    rates[name].append(rate)
        base = statistics.median(rates["base engine, base model"])
        rows += [{"num_seqs": num_seqs, "run": name, "output_tok_s": statistics.median(r),
                  "vs_base": statistics.median(r) / base, "rounds": " ".join(f"{x:.0f}" for x in r)}
                 for name, r in rates.items()]
    print_table(rows, ["num_seqs", "run", "output_tok_s", "vs_base", "rounds"])

    table = engines["lora"].llm_engine.runner.lora
    slot_bytes = sum(array.nbytes for p in table.projections for array in p.arrays) // len(RANKS)
    # Each token multiplies through every slot's factors: in + out per rank row, per projection and layer.
    slot_macs = sum(max(RANKS) * (fan_in + fan_out) for _, fan_in, fan_out in projection_shapes(config).values())
    slot_macs *= config["num_hidden_layers"]
    print(f"one more resident adapter (rank {max(RANKS)}): {slot_bytes / 2**20:.1f} MiB of device memory, "
          f"{slot_macs / 1e6:.1f} M multiply-adds per token")
    write_json(args.result_json, {"speed": rows, "adapter_ranks": RANKS, "targets": TARGETS, "options": options,
                                  "slot_bytes": slot_bytes, "slot_macs_per_token": slot_macs})


if __name__ == "__main__":
    main()
