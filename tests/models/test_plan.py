"""`cbjax plan`: per-device weights, KV capacity and the decode roofline, checked by hand."""

from __future__ import annotations

import pytest

from cbjax.plan.accelerators import ACCELERATORS, GiB, accelerator
from cbjax.entrypoints.cli.main import main
from cbjax.plan.capacity import load_model_config, plan_capacity


def plan(preset: str, device: str, tp: int, **options):
    name, config = load_model_config(preset)
    return plan_capacity(name, config, ACCELERATORS[device], tp, **options)


def test_llama3_8b_on_two_h100s_matches_the_arithmetic():
    p = plan("llama-3-8b", "h100", 2, max_model_len=8192)
    # Llama-3-8B: hidden 4096, 32 heads of 128, 8 KV heads, intermediate 14336, 32 layers, vocab 128256, bf16.
    # Per layer and device: q and o 4096*4096/2 each, k and v 4096*1024/2 each, gate/up/down 4096*14336/2 each,
    # two norms of 4096 (replicated); embedding and LM head 128256*4096/2 each; the final norm 4096.
    per_layer = 2 * 4096 * 4096 // 2 + 2 * 4096 * 1024 // 2 + 3 * 4096 * 14336 // 2 + 2 * 4096
    params = 32 * per_layer + 2 * 128256 * 4096 // 2 + 4096
    assert p.weight_bytes_per_device == 2 * params == 8_030_527_488  # half of Llama-3-8B's 8.03 B parameters
    # K and V, 4 of the 8 KV heads, head_dim 128, 2 bytes, 32 layers.
    assert p.kv_heads_per_device == 4 and p.kv_head_replicas == 1
    assert p.kv_bytes_per_token_per_device == 2 * 4 * 128 * 2 * 32 == 65_536
    # 90% of 80 GiB, minus the weights, in blocks of 16 tokens * 65,536 bytes = 1 MiB; one is the null block.
    free = int(80 * GiB * 0.9) - 8_030_527_488
    assert free == 69_278_883_840 and p.num_kv_blocks == 69_278_883_840 // 2**20 == 66_069
    assert p.max_concurrent_tokens == 66_068 * 16 == 1_057_088
    assert p.max_concurrent_seqs == 66_068 // (8192 // 16) == 129
    # Batch 1 at context 8192 reads the weights plus 8192 tokens of KV at 3.35 TB/s.
    one = p.roofline[0]
    assert one.batch_size == 1 and one.bytes_read == 8_030_527_488 + 8192 * 65_536
    assert one.step_ms == pytest.approx(8_567_398_400 / 3.35e12 * 1e3)
    assert one.tokens_per_s == pytest.approx(3.35e12 / 8_567_398_400)
    # 128 sequences of 8192 tokens take 65,536 of the 66,068 blocks; 256 would need 131,072.
    assert [(r.batch_size, r.fits) for r in p.roofline[-2:]] == [(128, True), (256, False)]
    assert [r.batch_size for r in p.roofline] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_fp8_kv_cache_halves_float16s_bytes_per_token_and_doubles_its_blocks():
    half, fp8 = (plan("llama-3-8b", "h100", 2, max_model_len=8192, kv_cache_dtype_name=name) for name in ("float16", "fp8"))
    assert fp8.kv_cache_dtype == "float8_e4m3fn"
    assert fp8.kv_bytes_per_token_per_device == half.kv_bytes_per_token_per_device // 2 == 2 * 4 * 128 * 1 * 32
    # The same free bytes in blocks of 16 tokens * 32,768 bytes (float16's: 1 MiB, 66,069 of them).
    assert half.num_kv_blocks == 66_069 and fp8.num_kv_blocks == 69_278_883_840 // 2**19 == 132_138


def test_fewer_kv_heads_than_devices_replicates_them_and_says_what_it_costs():
    p = plan("llama-3-70b", "h100", 16)
    # 8 KV heads on 16 devices: each device holds one whole head (k/v 8192 x 128), each head on 2 devices.
    per_layer = 2 * 8192 * 8192 // 16 + 2 * 8192 * 128 + 3 * 8192 * 28672 // 16 + 2 * 8192
    params = 80 * per_layer + 2 * (128256 // 16) * 8192 + 8192
    assert p.weight_bytes_per_device == 2 * params == 8_989_458_432
    assert p.kv_heads_per_device == 1 and p.kv_head_replicas == 2
    assert p.kv_bytes_per_token_per_device == 2 * 1 * 128 * 2 * 80 == 40_960
    # An even split would be half a head per device: the replication costs the other half.
    assert p.kv_replication_bytes_per_token == 20_480


def test_qwen2_biases_split_with_their_columns():
    p = plan("qwen2.5-72b", "h200", 8)
    # Qwen2.5-72B: q/k/v carry biases, split like their output columns; intermediate 29568, vocab 152064.
    per_layer = (
        2 * 8192 * 8192 // 8 + 8192 // 8  # q (+ bias) and o
        + 2 * (8192 * 1024 // 8 + 1024 // 8)  # k and v (+ biases)
        + 3 * 8192 * 29568 // 8 + 2 * 8192  # MLP, norms
    )
    assert p.weight_bytes_per_device == 2 * (80 * per_layer + 2 * 152064 // 8 * 8192 + 8192)


def test_int8_projections_count_a_byte_a_weight_and_a_float32_scale_a_column():
    p = plan("llama-3-8b", "h100", 2, max_model_len=8192, quantization="int8")
    # Per layer and device, each projection int8 with scales [out] in float32: q/k/v and gate/up split by columns
    # (their scales too), o and down by rows (their 4096 scales whole on each device); norms, embedding, LM head bf16.
    columns = 4096 * 4096 // 2 + 4 * 4096 // 2 + 2 * (4096 * 1024 // 2 + 4 * 1024 // 2) + 2 * (4096 * 14336 // 2 + 4 * 14336 // 2)
    rows = 4096 * 4096 // 2 + 4 * 4096 + 14336 * 4096 // 2 + 4 * 4096
    per_layer = columns + rows + 2 * 2 * 4096
    assert p.weight_bytes_per_device == 32 * per_layer + 2 * (2 * 128256 * 4096 // 2 + 4096) == 4_544_143_360
    assert p.quantization == "int8" and p.parameters == plan("llama-3-8b", "h100", 2, max_model_len=8192).parameters
    assert p.roofline[0].bytes_read == 4_544_143_360 + 8192 * p.kv_bytes_per_token_per_device


def test_int4_projections_count_half_a_byte_a_weight_and_a_scale_and_min_a_group():
    p = plan("llama-3-8b", "h100", 2, max_model_len=8192, quantization="int4")
    # Nibbles: half a byte a weight; scales and mins, float32, per 128 inputs a column: [in / 128, out], split by
    # columns beside q/k/v and gate/up, by groups beside o and down (2048 and 7168 rows a device: 16 and 56 groups).
    def projection(k, n, tp_rows=1, tp_columns=1):
        return (k // tp_rows) * (n // tp_columns) // 2 + 8 * (k // 128 // tp_rows) * (n // tp_columns)
    per_layer = (projection(4096, 4096, tp_columns=2) + 2 * projection(4096, 1024, tp_columns=2)
                 + 2 * projection(4096, 14336, tp_columns=2) + projection(4096, 4096, tp_rows=2)
                 + projection(14336, 4096, tp_rows=2) + 2 * 2 * 4096)
    assert p.weight_bytes_per_device == 32 * per_layer + 2 * (2 * 128256 * 4096 // 2 + 4096) == 3_014_139_904


def test_cli_plans_int4_and_refuses_groups_that_do_not_split(capsys):
    main(["plan", "--config", "llama-3-70b", "--device", "h200", "--tensor-parallel-size", "8", "--quantization", "int4-g64"])
    assert "weights bfloat16 (decoder projections int4-g64), KV cache bfloat16" in capsys.readouterr().out
    # 64 devices: down_proj's 28672 inputs leave 448 a device, 3.5 groups of 128.
    with pytest.raises(SystemExit, match=r"model\.layers\.0\.mlp\.down_proj cannot be split over tensor_parallel_size=64: "
                                         r"its K=28672 input rows are in 224 groups of G=128.* \(1, 2, 4, 8, 16, 32\), or a "
                                         r"group size that divides 448: quantization='int4-g64' or 'int4-g32' of a float"):
        main(["plan", "--config", "llama-3-70b", "--device", "h200", "--tensor-parallel-size", "64", "--quantization", "int4"])


@pytest.mark.parametrize(
    ("preset", "device", "tp", "options", "message"),
    [
        ("llama-3-70b", "h100", 3, {}, "num_attention_heads=64 is not divisible by 3; num_key_value_heads=8"),
        ("llama-3-70b", "h100", 3, {}, "valid sizes: 1, 2, 4, 8, 16, 32, 64"),
        ("qwen2.5-7b", "h100", 8, {}, "num_attention_heads=28 is not divisible by 8"),
        ("llama-3-70b", "h100", 1, {}, "131.4 GiB per device at tensor_parallel_size=1; one h100 gives 72.0 GiB"),
        ("llama-3-70b", "h100", 1, {}, "use tensor_parallel_size=2"),
        ("llama-3-8b", "h100", 1, {"max_model_len": 100_000}, "exceeds the model's max_position_embeddings=8192"),
        # 2 x H100 hold 65.7 GiB of Llama-3.1-70B each, leaving room for about 41k tokens, not 131072.
        ("llama-3.1-70b", "h100", 2, {"max_model_len": 131072}, "cannot hold one request of max_model_len=131072"),
    ],
)
def test_what_cannot_run_is_refused_with_the_numbers(preset, device, tp, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        plan(preset, device, tp, **options)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="neither a preset .*llama-3-70b.*qwen2.5-72b"):
        load_model_config("llama-4-9000b")
    with pytest.raises(ValueError, match="unknown device 'h900'; known: h100, h100-pcie, h200"):
        accelerator("h900")


def test_cli_exits_with_the_refusal():
    with pytest.raises(SystemExit, match="cbjax plan: tensor_parallel_size=5 cannot split .* valid sizes: 1, 2, 4, 8"):
        main(["plan", "--config", "llama-3-8b", "--device", "h100", "--tensor-parallel-size", "5"])


def test_cli_prints_the_llama3_70b_plan_on_eight_h200s(capsys):
    main(["plan", "--config", "llama-3-70b", "--device", "h200", "--tensor-parallel-size", "8", "--max-model-len", "8192"])
    out = capsys.readouterr().out
    # 70.55 B parameters in bf16 over 8 devices; 1 of the 8 KV heads per device: 2 * 128 * 2 bytes * 80 layers.
    assert "weights per device:            16.43 GiB (17,640,734,720 bytes)" in out
    assert "KV cache per token per device: 40,960 bytes" in out
    assert "replicated" not in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # Batch 1: the 17.64 GB shard plus 8192 * 40,960 bytes of KV at 4.8 TB/s.
    assert float(rows[0][2]) == pytest.approx((17_640_734_720 + 8192 * 40_960) / 4.8e12 * 1e3, abs=0.01)


def test_qwen3_30b_a3b_counts_every_expert_in_memory_and_top_8_of_128_per_token():
    p = plan("qwen3-30b-a3b", "h100", 4, max_model_len=8192)
    # Per layer and device: q and o 2048 x 4096 / 4; 1 of the 4 KV heads (k, v 2048 x 128); q/k norms (128),
    # the router (2048 x 128) and two norms (2048) replicated; 128 experts' gate/up/down 2048 x 768 / 4.
    experts = 128 * 3 * 2048 * 768 // 4
    per_layer = 2 * 2048 * 4096 // 4 + 2 * 2048 * 128 + 2 * 128 + 2048 * 128 + 2 * 2048 + experts
    assert p.weight_bytes_per_device == 2 * (48 * per_layer + 2 * 151936 // 4 * 2048 + 2048) == 15_285_252_096
    assert p.expert_bytes_per_device == 2 * 48 * experts
    # Qwen3-30B-A3B's 30.5 B parameters, 3.3 B active: per layer 8 of the 128 experts.
    layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2048 * 128 + 2 * 2048
    assert p.parameters == 48 * (layer + 128 * 3 * 2048 * 768) + 2 * 151936 * 2048 + 2048 == 30_532_122_624
    assert p.active_parameters == 48 * (layer + 8 * 3 * 2048 * 768) + 2 * 151936 * 2048 + 2048 == 3_353_032_704
    # Batch 1 reads its 8 experts of 128 in each layer; batch 256 nearly all of them.
    one, last = p.roofline[0], p.roofline[-1]
    assert one.bytes_read == round(p.weight_bytes_per_device - p.expert_bytes_per_device * 120 / 128) + 8192 * p.kv_bytes_per_token_per_device
    assert last.bytes_read == pytest.approx(p.weight_bytes_per_device + 256 * 8192 * p.kv_bytes_per_token_per_device, rel=1e-6)


def test_mixtral_8x7b_is_46_7_b_parameters_12_9_b_active():
    p = plan("mixtral-8x7b", "h200", 2, max_model_len=8192)
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 4096  # attention, router, norms
    experts = 8 * 3 * 4096 * 14336
    assert p.parameters == 32 * (layer + experts) + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    assert p.active_parameters == 32 * (layer + experts // 4) + 2 * 32000 * 4096 + 4096 == 12_879_925_248
    assert p.expert_bytes_per_device == 2 * 32 * experts // 2


def test_cli_prints_total_and_active_parameters_of_a_moe_preset(capsys):
    main(["plan", "--config", "mixtral-8x7b", "--device", "h200", "--tensor-parallel-size", "2"])
    out = capsys.readouterr().out
    assert "parameters:                    46.70 B, 12.88 B active per token" in out
    assert "experts 42.00 GiB" in out


def test_expert_parallel_holds_whole_experts_and_refuses_more_devices_than_experts(capsys):
    # Mixtral's 8 experts over 8 devices: one whole expert (gate/up/down 4096 x 14336) per layer and device,
    # the same bytes as 1/8 of every expert under TP.
    main(["plan", "--config", "mixtral-8x7b", "--device", "h200", "--tensor-parallel-size", "8", "--enable-expert-parallel"])
    out = capsys.readouterr().out
    assert f"experts {2 * 32 * 3 * 4096 * 14336 / 2**30:.2f} GiB (expert parallel" in out
    # 16 devices split each expert's 14336 columns under TP, but cannot hold whole experts: 8 of them.
    assert plan("mixtral-8x7b", "h200", 16).expert_bytes_per_device == 2 * 32 * 8 * 3 * 4096 * 14336 // 16
    with pytest.raises(SystemExit, match="num_experts=8 is not divisible by 16 .* valid sizes: 1, 2, 4, 8$"):
        main(["plan", "--config", "mixtral-8x7b", "--device", "h200", "--tensor-parallel-size", "16", "--enable-expert-parallel"])
