"""llama.cpp's side of benchmarks/quantization.py: run in the llama-cpp-python peer venv (no cbjax there).

    <peer venv>/bin/python benchmarks/llamacpp_worker.py JOB.json     # prints one JSON line

JOB: {"gguf": path, "threads": n, "runs": [{"num_seqs": S, "prompts": [[token ids], ...], "output_len": L}, ...]}.
Each run decodes its prompts as S sequences of one llama.cpp context at once (llama_batch with a seq id per
sequence: every step one batch of S tokens, as llama-server's parallel slots do), greedy (the argmax of each
sequence's logits), `output_len` tokens each, EOS ignored; the KV cache is cleared between runs. Reported per
run: output tokens/s over the whole run (prompts included, as cbjax's generate is timed), and the tokens.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
import numpy as np


def decode(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
    """One llama_decode of (token, position, sequence, wants logits) entries."""
    for i, (token, position, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
        batch.seq_id[i][0] = seq
    batch.n_tokens = len(entries)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError(f"llama_decode failed on a batch of {len(entries)} tokens")


def run(model, n_vocab: int, threads: int, prompts: list[list[int]], output_len: int) -> dict:
    num_seqs = len(prompts)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = max(512, num_seqs * (max(map(len, prompts)) + output_len + 16))
    params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))  # the prompts in one decode
    params.n_seq_max = num_seqs
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False  # each sequence its own cache stream: no shared prefixes here
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    try:
        start = time.perf_counter()
        entries, last_row = [], {}
        for seq, prompt in enumerate(prompts):
            for position, token in enumerate(prompt):
                entries.append((token, position, seq, position == len(prompt) - 1))
            last_row[seq] = len(entries) - 1
        decode(ctx, batch, entries)
        outputs = [[] for _ in prompts]
        while True:
            for seq in range(num_seqs):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, last_row[seq]), shape=(n_vocab,))
                outputs[seq].append(int(logits.argmax()))
            if len(outputs[0]) == output_len:
                break
            decode(ctx, batch, [(outputs[seq][-1], len(prompts[seq]) + len(outputs[seq]) - 1, seq, True)
                                for seq in range(num_seqs)])
            last_row = {seq: seq for seq in range(num_seqs)}
        elapsed = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return {"num_seqs": num_seqs, "output_tok_s": num_seqs * output_len / elapsed, "seconds": elapsed,
            "token_ids": outputs}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(job["gguf"].encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['gguf']}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    results = [run(model, n_vocab, job["threads"], r["prompts"], r["output_len"]) for r in job["runs"]]
    llama_cpp.llama_model_free(model)
    print(json.dumps({"version": llama_cpp.__version__, "runs": results}))


if __name__ == "__main__":
    main()
