"""Multi-LoRA serving end to end against transformers + peft (the adapters are made by peft here, with
random A and B, and applied by peft unmerged): each request gets exactly the greedy tokens of its adapter.

A tiny Llama (q/k/v and gate/up fused at load) with max_loras=2, so three adapters and the base share
the engine by reusing slots. The second architecture, Qwen3 (q wider than hidden, q/k norms), runs three
adapters and the base in one step under tensor parallelism (test_lora_tensor_parallel.py).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import httpx
import peft
import pytest
import torch
from prometheus_client import CollectorRegistry
from engine_helpers import COMPILES, ENGINE_OPTIONS, random_prompts
from helpers_hf import load_hf_model
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, AsyncLLM, LoRARequest, RequestOutputKind, SamplingParams
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.entrypoints.openai.app import build_app
from cbjax.entrypoints.openai.lora_adapters import ALLOW_RUNTIME_UPDATING, VLLM_ALLOW_RUNTIME_UPDATING, load_adapter
from cbjax.entrypoints.openai.serving import ServerState

NUM_TOKENS = 6
# name -> (rank, target modules, rsLoRA)
ADAPTERS = {
    "attn-qv": (4, ["q_proj", "v_proj"], False),
    "everything": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp-up-down": (2, ["up_proj", "down_proj"], False),
}


def make_adapters(root: Path, hf_dir: Path) -> dict[str, peft.PeftModel]:
    """Each of ADAPTERS made by peft with random factors (init_lora_weights=False: B is not zero), saved under root."""
    models = {}
    for seed, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora,
                                 init_lora_weights=False)
        models[name] = peft.get_peft_model(copy.deepcopy(load_hf_model(hf_dir)), config).eval()
        models[name].save_pretrained(root / name)
    return models


def greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class Served:
    def __init__(self, root: Path, arch: str, max_loras: int):
        self.hf_dir, checkpoint = make_tiny_checkpoint(root, arch)
        self.references = {None: load_hf_model(self.hf_dir), **make_adapters(root, self.hf_dir)}
        self.requests = {None: None, **{name: LoRARequest(name, index + 1, str(root / name))
                                        for index, name in enumerate(ADAPTERS)}}
        self.llm = LLM(str(checkpoint), enable_lora=True, max_loras=max_loras, max_lora_rank=8, **ENGINE_OPTIONS)

    def check(self, prompts: list[list[int]], names: list[str | None]) -> list:
        """Generate each prompt under its adapter in one call; assert peft's greedy tokens; the outputs."""
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
                                    lora_request=[self.requests[name] for name in names], use_tqdm=False)
        for prompt, name, output in zip(prompts, names, outputs):
            assert list(output.outputs[0].token_ids) == greedy(self.references[name], prompt, NUM_TOKENS), name
        return outputs


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Served:
    return Served(tmp_path_factory.mktemp("lora-llama"), "llama", max_loras=2)


def test_more_adapters_than_slots_reuse_slots_without_compiling(llama):
    """max_loras=2 with three adapters: the scheduler holds a request until a slot frees, the LRU
    evicts an idle adapter, and every request still gets its adapter's tokens; nothing compiles."""
    COMPILES.armed, COMPILES.count = True, 0
    try:
        llama.check(random_prompts(2, [9, 5, 12, 7]), [None, "attn-qv", "everything", "mlp-up-down"])
        for name in ["mlp-up-down", "attn-qv", "everything", None]:  # in turn, each alone
            llama.check(random_prompts(3, [8]), [name])
    finally:
        COMPILES.armed = False
    assert COMPILES.count == 0


def test_prefix_cache_never_shares_blocks_across_adapters(llama):
    """The same 3-block prompt: under a second adapter it is computed again; under the first again it is cached."""
    prompt = random_prompts(4, [3 * ENGINE_OPTIONS["block_size"] + 1])
    first, = llama.check(prompt, ["attn-qv"])
    other, = llama.check(prompt, ["everything"])
    base, = llama.check(prompt, [None])
    again, = llama.check(prompt, ["attn-qv"])
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 3 * ENGINE_OPTIONS["block_size"]


def test_bad_adapters_fail_at_add_naming_the_adapter_and_the_value(llama, tmp_path):
    llm, prompt = llama.llm, {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"'gone'.*does not exist"):
        llm.generate(prompt, lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")), use_tqdm=False)
    torch.manual_seed(0)
    wide = peft.get_peft_model(copy.deepcopy(llama.references[None]), peft.LoraConfig(r=16, target_modules=["q_proj"]))
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match=r"'wide'.*r=16 exceeds max_lora_rank=8"):
        llm.generate(prompt, lora_request=LoRARequest("wide", 10, str(tmp_path / "wide")), use_tqdm=False)
    head = peft.get_peft_model(copy.deepcopy(llama.references[None]), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match=r"'head'.*target_modules \['lm_head'\]"):
        llm.generate(prompt, lora_request=LoRARequest("head", 11, str(tmp_path / "head")), use_tqdm=False)
    other = load_hf_model(make_tiny_checkpoint(tmp_path / "other", "llama", hidden_size=32)[0])
    peft.get_peft_model(copy.deepcopy(other), peft.LoraConfig(r=2, target_modules=["v_proj"])).save_pretrained(tmp_path / "other-base")
    with pytest.raises(ValueError, match=r"'other-base'.*lora_A \(2, 32\).*needs \(2, 64\)"):
        llm.generate(prompt, lora_request=LoRARequest("other-base", 12, str(tmp_path / "other-base")), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_an_adapter_id_names_one_adapter(llama):
    taken = llama.requests["attn-qv"]
    with pytest.raises(ValueError, match=r"lora_int_id=1 is adapter 'attn-qv'"):
        llama.llm.generate({"prompt_token_ids": [5]}, lora_request=LoRARequest("impostor", 1, taken.lora_path),
                           use_tqdm=False)


def test_lora_request_without_enable_lora_is_refused(llama, tmp_path):
    """Refused as it is added (an engine that compiles nothing: no step runs)."""
    engine = LLMEngine(EngineConfig(model=llama.llm.llm_engine.config.model, **ENGINE_OPTIONS), precompile=False,
                       progress=False)
    with pytest.raises(ValueError, match="without enable_lora; start it with enable_lora=True"):
        engine.add_request("r", {"prompt_token_ids": [5]}, lora_request=LoRARequest("any", 1, str(tmp_path)))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("zero", 0, str(tmp_path))


@pytest.fixture(scope="module")
def async_llama(llama) -> AsyncLLM:
    """AsyncLLM over the Qwen3 engine, for the tests below (its core thread steps the engine from then on)."""
    async_llm = AsyncLLM.from_engine(llama.llm.llm_engine)
    yield async_llm
    async_llm.shutdown()


def test_async_llm_serves_adapters_side_by_side_and_loads_and_forgets_them(llama, async_llama):
    prompts, names = random_prompts(5, [6, 9, 4]), ["everything", None, "mlp-up-down"]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(index: int) -> list[int]:
        stream = async_llama.generate({"prompt_token_ids": prompts[index]}, params, f"async-{index}",
                                      lora_request=llama.requests[names[index]])
        return [list(output.outputs[0].token_ids) async for output in stream][-1]

    async def scenario() -> list[list[int]]:
        await async_llama.add_lora(LoRARequest("attn-qv-again", 7, llama.requests["attn-qv"].lora_path))
        assert await async_llama.remove_lora(7) and not await async_llama.remove_lora(7)
        with pytest.raises(ValueError, match="'nowhere'"):
            await async_llama.add_lora(LoRARequest("nowhere", 8, "/nonexistent/adapter"))
        return await asyncio.gather(*(one(index) for index in range(len(prompts))))

    tokens = asyncio.run(scenario())
    assert tokens == [greedy(llama.references[name], prompt, NUM_TOKENS) for prompt, name in zip(prompts, names)]


def test_server_serves_adapters_by_model_name_and_loads_them_at_run_time_when_allowed(llama, async_llama, monkeypatch):
    """`model` picks the adapter; /v1/models lists adapters with their parent; the runtime endpoints exist
    only with CBJAX_ALLOW_RUNTIME_LORA_UPDATING, behind the API key; unknown names are 404."""
    prompt = random_prompts(6, [7])[0]
    state = ServerState(async_llama, "base", 128, None, last_lora_int_id=100)  # the ids above 100 are the server's

    async def talk(app, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
        headers = {"Authorization": "Bearer sesame"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers) as client:
            return [await (client.get(path) if method == "GET" else client.post(path, json=body))
                    for method, path, body in calls]

    closed = build_app(state, CollectorRegistry(), "sesame", 1 << 20)
    asyncio.run(load_adapter(state, "sql", llama.requests["everything"].lora_path))  # as --lora-modules sql=PATH
    monkeypatch.setenv(VLLM_ALLOW_RUNTIME_UPDATING, "1")  # vLLM's name opens them too
    assert "/v1/load_lora_adapter" in {route.path for route in build_app(state, CollectorRegistry(), "sesame", 1 << 20).routes}
    monkeypatch.delenv(VLLM_ALLOW_RUNTIME_UPDATING)
    monkeypatch.setenv(ALLOW_RUNTIME_UPDATING, "true")
    app = build_app(state, CollectorRegistry(), "sesame", 1 << 20)
    completion = {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True}
    load = {"lora_name": "up-down", "lora_path": llama.requests["mlp-up-down"].lora_path}
    (forbidden,) = asyncio.run(talk(closed, [("POST", "/v1/load_lora_adapter", load)]))
    responses = asyncio.run(talk(app, [
        ("POST", "/v1/load_lora_adapter", load),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {**completion, "model": "sql"}),
        ("POST", "/v1/completions", {**completion, "model": "up-down"}),
        ("POST", "/v1/completions", {**completion, "model": "base"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "up-down"}),
        ("POST", "/v1/completions", {**completion, "model": "up-down"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "up-down"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": "/nonexistent"}),
    ]))
    assert forbidden.status_code == 404
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 200, 200, 404, 404, 400]
    cards = {card["id"]: card.get("parent") for card in responses[1].json()["data"]}
    assert cards == {"base": None, "sql": "base", "up-down": "base"}
    texts = [r.json()["choices"][0]["text"] for r in responses[2:5]]
    tokenizer = async_llama.get_tokenizer()
    # Each is peft's greedy continuation under that adapter, decoded (a trailing partial UTF-8 character is held back).
    expected = [tokenizer.decode(greedy(llama.references[name], prompt, NUM_TOKENS))
                for name in ["everything", "mlp-up-down", None]]
    assert all(full.startswith(text) and len(full) - len(text) <= 1 for text, full in zip(texts, expected)), (texts, expected)
    assert len(set(expected)) == 3
    assert [r.json()["model"] for r in responses[2:5]] == ["sql", "up-down", "base"]
    assert "`up-down` does not exist" in responses[6].json()["error"]["message"]
    assert "'broken'" in responses[8].json()["error"]["message"]
