"""A/B: ModelRunner.prepare of an earlier commit (per-row numpy) vs this checkout's (columns), on the
same scheduled rows in one process, alternating; checks both pack identical inputs.

    python benchmarks/prepare_columns_ab.py [BEFORE_COMMIT]   (default c867c86, before the change)
"""
import importlib.util, pathlib, statistics, subprocess, sys, tempfile, time, types
import numpy as np
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BEFORE = sys.argv[1] if len(sys.argv) > 1 else "c867c86"
OLD_RUNNER = pathlib.Path(tempfile.mkdtemp()) / "old_runner.py"
OLD_RUNNER.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:cbjax/engine/runner.py"],
                                     capture_output=True, text=True, check=True).stdout)
from cbjax.engine import runner as new_mod
from cbjax.engine.buckets import compute_buckets
from cbjax.engine.penalty_state import PenaltySlots
from cbjax.engine.request import Request
from cbjax.engine.scheduler import ScheduledRequest, SchedulerOutput
from cbjax.sampling_params import SamplingParams
from cbjax.engine.packing import pack
spec = importlib.util.spec_from_file_location("old_runner", OLD_RUNNER)
old_mod = importlib.util.module_from_spec(spec); sys.modules["old_runner"] = old_mod; spec.loader.exec_module(old_mod)

def make(mod, max_model_len, num_seqs):
    r = mod.ModelRunner.__new__(mod.ModelRunner)
    r.config = types.SimpleNamespace(max_num_prefills=8, max_logprobs=20, seed=0)
    r.block_size = 16
    r.max_blocks_per_seq = -(-max_model_len // 16)
    r.penalty_slots = PenaltySlots(num_seqs)
    r.buckets = compute_buckets(num_seqs, 512)
    r._last_sampling_rows = {}
    r.request_seeds = {}
    r._prepared, r.follow_decode_steps = None, False  # every step row by row (persistent_batch.py aside)
    return r

def workload(num_seqs, rng, mixed):
    rows = []
    for i in range(num_seqs):
        params = SamplingParams(temperature=0.0, max_tokens=64, presence_penalty=0.5 if i % 3 == 0 else 0.0,
                                prompt_logprobs=1 if i % 5 == 0 else None)
        prompt = rng.integers(3, 1000, size=int(rng.integers(1, 60))).tolist()
        req = Request(f"r{i}", prompt, params)
        for _ in range(int(rng.integers(0, 30))):
            req.append_output_token(int(rng.integers(3, 1000)))
        nblocks = -(-(req.num_tokens + 1) // 16)
        req.block_ids = rng.permutation(np.arange(1, 5000))[:nblocks].tolist()
        if mixed and i < 4:
            start, n = 0, req.num_tokens
        else:
            start, n = req.num_tokens - 1, 1
        req.num_computed_tokens = start + n
        req.num_output_placeholders = 1
        rows.append(ScheduledRequest(req, n, start, True))
    return SchedulerOutput(rows, [])

rng = np.random.default_rng(0)
for num_seqs in (64, 256):
    for max_model_len in (1024, 8192):
        for mixed in (False, True):
            sched = workload(num_seqs, rng, mixed)
            a, b = make(old_mod, max_model_len, num_seqs), make(new_mod, max_model_len, num_seqs)
            ba, ia = a.prepare(sched); bb, ib = b.prepare(sched)
            assert ba == bb and np.array_equal(pack(ia), pack(ib)), "packed inputs differ"
            ta, tb = [], []
            for _ in range(100):
                t = time.perf_counter(); a.prepare(sched); ta.append(time.perf_counter() - t)
                t = time.perf_counter(); b.prepare(sched); tb.append(time.perf_counter() - t)
            ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
            print(f"seqs {num_seqs} max_model_len {max_model_len} mixed {mixed}: before {ma:.3f} ms, after {mb:.3f} ms, ratio {ma/mb:.2f}x (identical packed inputs)")
