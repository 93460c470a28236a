"""LoRA adapters in the engine: PEFT's own model is the oracle.

Adapters are made with PEFT (tests/lora_adapters.py) on a tiny Llama, saved as PEFT saves them and read back through
Ferry's loading path. Each adapter's greedy tokens and logprobs equal PEFT's model with that adapter (and the merged
model); a batch mixing adapters and the base under chunked prefill, preemption and prefix sharing gives each request
what it gets alone; the prefix cache never shares pages across adapters; the slots, the memory LRU, the
scheduler's max_loras, tensor parallelism, async scheduling, structured output and a quantized base all hold.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from engine import EngineConfig, EngineCore, SamplingParams, StructuredOutput, generate_batch
from engine.config import EngineStartupError, ModelConfig
from engine.core.request import LoRARequest, RequestRejected
from engine.execution.cuda_graphs import StepFn, graph_sizes, max_graph_size
from engine.kernels.library import cpu_kernels_available
from engine.layers.linear import ColumnParallelLinear
from engine.layers.linear_method import UnquantizedLinearMethod
from engine.lora.adapter import AdapterError, read_adapter
from engine.lora.batch import LoRABatch
from engine.lora.slots import LoRALayer
from engine.quantization import quantized_linear_method
from tests.lora_adapters import ADAPTER_SPECS, build_adapter_dir, build_adapters, peft_model
from tests.model_factory import build_model_dir
from tests.quantized_reference import check_against, prompts_for, reference_model, tolerance_of
from tests.test_cpu_attention import needs_kernel
from tests.test_engine_equivalence import LOGPROB_TOLERANCE
from tests.test_scheduler import make_request, make_scheduler, sample

pytestmark = pytest.mark.timeout(300)

NAMES = list(ADAPTER_SPECS)
MAX_NEW = 10
SHARED = [7, 19, 23, 101, 5, 88, 41, 3, 250, 12, 9, 77, 64, 31, 200, 150]
"""A 16-token prefix every mixed-batch prompt starts with (four pages of 4)."""


@pytest.fixture(scope="module")
def base(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_adapters(base, tmp_path_factory.mktemp("adapters"))


def lora_request(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(name, NAMES.index(name) + 1, str(adapters[name]))


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], max_new: int = MAX_NEW) -> tuple[list[int], list[float]]:
    """The model's greedy tokens and their logprobs, one full forward pass per token."""
    ids, logprobs = list(prompt), []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], logprobs


_references: dict[tuple[str | None, tuple[int, ...]], tuple[list[int], list[float]]] = {}


def reference(
    base: Path, adapters: dict[str, Path], name: str | None, prompt: list[int]
) -> tuple[list[int], list[float]]:
    """PEFT's greedy output for `prompt` with adapter `name` (None: the base model), memoised."""
    key = (name, tuple(prompt))
    if key not in _references:
        if name is None:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        else:
            model = peft_model(base, adapters[name])
        _references[key] = greedy(model, prompt)
    return _references[key]


def test_each_adapter_alone_equals_peft_and_the_merged_model(base: Path, adapters: dict[str, Path]) -> None:
    prompt = [11, 45, 2, 99, 130, 7, 64, 3, 18]
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=2, debug_checks=True)
    outputs = set()
    with EngineCore(config) as engine:
        for name in [None, *NAMES]:
            lora = None if name is None else lora_request(adapters, name)
            params = SamplingParams(max_new_tokens=MAX_NEW, logprobs=True)
            got = generate_batch([prompt], params=params, engine=engine, loras=[lora])["req_0"]
            tokens, logprobs = reference(base, adapters, name, prompt)
            assert got.generated_ids == tokens, f"adapter {name}: tokens differ from PEFT's"
            worst = max(abs(t.logprob - want) for t, want in zip(got.logprobs, logprobs, strict=True))
            assert worst <= LOGPROB_TOLERANCE, f"adapter {name}: a logprob is {worst:.2e} off PEFT's"
            if name is not None:
                merged = peft_model(base, adapters[name]).merge_and_unload()
                assert greedy(merged, prompt)[0] == tokens, f"adapter {name}: the merged model disagrees"
            outputs.add(tuple(tokens))
        assert engine.is_idle_and_clean()
    assert len(outputs) == 1 + len(NAMES), "every adapter changes this prompt's output"


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(base: Path, adapters: dict[str, Path]) -> None:
    """Four adapters and the base, two prompts each, in one engine that chunks prefills (32-token steps), preempts
    (too few pages) and shares the common prefix: every request equals PEFT alone."""
    names: list[str | None] = [None, "attn-r8", "mlp-r4", "all-r16", "qv-r16-rslora"]
    prompts, loras, expected = [], [], []
    for i, name in enumerate(names):
        for j in range(2):
            prompt = SHARED + [(37 * i + 11 * j + k) % 380 + 3 for k in range(8 + 14 * j)]
            prompts.append(prompt)
            loras.append(None if name is None else lora_request(adapters, name))
            expected.append(reference(base, adapters, name, prompt)[0])
    config = EngineConfig.of(
        model=str(base), enable_lora=True, max_loras=4, debug_checks=True, max_batch_tokens=32, page_size=4,
        num_pages=26,
    )  # fmt: skip
    with EngineCore(config) as engine:
        results = generate_batch(prompts, params=SamplingParams(max_new_tokens=MAX_NEW), engine=engine, loras=loras)
        for i, want in enumerate(expected):
            assert results[f"req_{i}"].generated_ids == want, f"request {i} ({names[i // 2]}) differs in the batch"
        assert max(len(p) for p in prompts) > 32
        assert engine.scheduler.num_preemptions > 0
        assert engine.stats().prefix_cache_hits > 0
        assert engine.is_idle_and_clean()


def test_the_prefix_cache_shares_pages_within_an_adapter_never_across(base: Path, adapters: dict[str, Path]) -> None:
    prompt = [*SHARED, 5, 6, 7]
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=2, page_size=4)
    with EngineCore(config) as engine:

        def cached(name: str | None, lora_id: int | None = None) -> int:
            lora = None if name is None else LoRARequest(name, lora_id or NAMES.index(name) + 1, str(adapters[name]))
            out = generate_batch([prompt], params=SamplingParams(max_new_tokens=2), engine=engine, loras=[lora])
            return out["req_0"].num_cached_tokens

        assert cached("attn-r8") == 0
        assert cached("attn-r8") == len(SHARED)  # the same adapter shares every full prompt page
        assert cached("mlp-r4") == 0  # another adapter: none, though the tokens are equal
        assert cached(None) == 0  # nor the base
        assert cached(None) == len(SHARED)
        # The same files loaded again (a new id) are another adapter to the cache: they could have changed.
        assert cached("attn-r8", lora_id=99) == 0


def test_the_memory_lru_evicts_and_reloads_with_five_adapters_in_use(base: Path, adapters: dict[str, Path]) -> None:
    prompt = [40, 41, 42, 43, 44, 45]
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, debug_checks=True)
    with EngineCore(config) as engine:
        manager = engine.runner.lora
        assert manager is not None
        for _ in range(2):
            loras = [lora_request(adapters, name) for name in NAMES]
            out = generate_batch([prompt] * len(NAMES), params=SamplingParams(max_new_tokens=4), engine=engine,
                                 loras=loras)  # fmt: skip
            for i, name in enumerate(NAMES):
                assert out[f"req_{i}"].generated_ids == reference(base, adapters, name, prompt)[0][:4], name
        assert manager.cache.loads > len(NAMES), "two kept in memory: later uses read the evicted ones again"
        assert len(list(manager.cache._adapters)) == 2


@settings(max_examples=30, deadline=None)
@given(
    adapter_of=st.lists(st.sampled_from([None, 1, 2, 3, 4, 5]), min_size=1, max_size=12), max_loras=st.integers(1, 3)
)
def test_the_running_requests_never_use_more_than_max_loras_adapters(
    adapter_of: list[int | None], max_loras: int
) -> None:
    scheduler = make_scheduler(num_pages=256)
    scheduler.max_loras = max_loras
    for i, lora_id in enumerate(adapter_of):
        request = make_request(f"r{i}", 6, max_new_tokens=3)
        if lora_id is not None:
            request.lora = LoRARequest(f"a{lora_id}", lora_id, "/nowhere")
        scheduler.add(request)
    for _ in range(500):
        if not scheduler.has_unfinished:
            break
        plan = scheduler.schedule()
        running = {r.lora.lora_id for r in scheduler.running if r.lora is not None}
        assert len(running) <= max_loras
        assert set(scheduler.lora_adapters()["running_lora_adapters"]) == {f"a{i}" for i in running}
        scheduler.update(plan, sample(scheduler, plan))
    assert not scheduler.has_unfinished, "every request ran: a blocked adapter waits, it is never starved"


def _plain(base: Path, directory: Path) -> Path:
    return build_adapter_dir(base, directory, r=4, lora_alpha=8, target_modules=["q_proj"])


def _edit_config(directory: Path, **changes: object) -> Path:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))
    return directory


def test_adapters_ferry_cannot_serve_exactly_are_refused_saying_why(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    hf_config = AutoConfig.from_pretrained(base)
    spec = read_adapter(adapters["qv-r16-rslora"], hf_config, 16)
    assert spec.rank == 16 and spec.scaling == pytest.approx(8 / 4)  # rsLoRA: alpha / sqrt(r)
    assert read_adapter(adapters["attn-r8"], hf_config, 16).scaling == 2.0
    refusals = {
        "rank 16, above --max-lora-rank 8": (adapters["all-r16"], 8),
        "DoRA": (build_adapter_dir(base, tmp_path / "dora", r=4, lora_alpha=8, target_modules=["q_proj"],
                                   use_dora=True), 16),
        "modules_to_save": (build_adapter_dir(base, tmp_path / "save", r=4, lora_alpha=8, target_modules=["q_proj"],
                                              modules_to_save=["lm_head"]), 16),
        "embedding or LM head": (build_adapter_dir(base, tmp_path / "embed", r=4, lora_alpha=8,
                                                   target_modules=["embed_tokens", "q_proj"]), 16),
        "not trained on this model": (build_adapter_dir(
            build_model_dir(tmp_path / "other", "llama", hidden_size=32), tmp_path / "other-adapter", r=4,
            lora_alpha=8, target_modules=["q_proj"]), 16),
        "is missing": (tmp_path / "nothing-here", 16),
        "per-module ranks": (_edit_config(_plain(base, tmp_path / "pattern"), rank_pattern={"q_proj": 2}), 16),
        "trains biases": (_edit_config(_plain(base, tmp_path / "bias"), bias="all"), 16),
    }  # fmt: skip
    for reason, (path, max_rank) in refusals.items():
        with pytest.raises(AdapterError, match=reason):
            read_adapter(path, hf_config, max_rank)
    pickled = build_adapter_dir(base, tmp_path / "bin", r=4, lora_alpha=8, target_modules=["q_proj"])
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="save the adapter with safetensors"):
        read_adapter(pickled, hf_config, 16)


def test_the_engine_refuses_what_it_cannot_run(
    base: Path, adapters: dict[str, Path], model_dir: Callable[[str], Path]
) -> None:
    with EngineCore(EngineConfig.of(model=str(base))) as engine, pytest.raises(RequestRejected, match="--enable-lora"):
        engine.add_request("r", [1, 2, 3], SamplingParams(), lora=lora_request(adapters, "attn-r8"))
    with EngineCore(EngineConfig.of(model=str(base), enable_lora=True, max_lora_rank=8)) as engine:
        with pytest.raises(RequestRejected, match="above --max-lora-rank 8") as refused:
            engine.add_request("r", [1, 2, 3], SamplingParams(), lora=lora_request(adapters, "all-r16"))
        assert refused.value.code == "invalid_lora"
    with pytest.raises(EngineStartupError, match="transformers fallback"):
        EngineCore(EngineConfig.of(model=str(model_dir("gpt2")), enable_lora=True))


@pytest.mark.parametrize("level", ["piecewise", "full"])
def test_compiled_layers_add_the_adapters_products(
    base: Path, adapters: dict[str, Path], level: str, compiling: None
) -> None:
    """Under --compile the products are one opaque op that reads the step's adapters: the warm-up's graphs (compiled
    without adapters) serve the base and every adapter, mixed, with no recompiling."""
    from torch._dynamo.utils import counters

    names: list[str | None] = [None, "all-r16", "mlp-r4", "ko-r6"]
    prompts = [[9, 31, 4, 250, 17, 60 + i] for i in range(len(names))]
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=4, compile=level, debug_checks=True)
    with EngineCore(config) as engine:
        warmed_up = counters["stats"]["unique_graphs"]
        out = generate_batch(prompts, params=SamplingParams(max_new_tokens=MAX_NEW), engine=engine,
                             loras=[None if n is None else lora_request(adapters, n) for n in names])  # fmt: skip
        assert counters["stats"]["unique_graphs"] == warmed_up, "a step with adapters recompiled"
    for i, name in enumerate(names):
        assert out[f"req_{i}"].generated_ids == reference(base, adapters, name, prompts[i])[0], name


def test_async_scheduling_structured_output_and_logprobs_run_per_adapter(base: Path, adapters: dict[str, Path]) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompt = [3, 14, 15, 92, 65]
    loras = [lora_request(adapters, name) for name in ("attn-r8", "all-r16")]
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, logprobs=True),
        SamplingParams(max_new_tokens=24, structured_output=StructuredOutput("json_schema", json.dumps(schema))),
    ]
    runs = []
    for async_scheduling in (False, True):
        config = EngineConfig.of(model=str(base), enable_lora=True, async_scheduling=async_scheduling)
        with EngineCore(config) as engine:
            runs.append(generate_batch([prompt, prompt], params=params, engine=engine, loras=loras))
    sync, planned_ahead = runs
    assert sync["req_0"].generated_ids == planned_ahead["req_0"].generated_ids
    assert sync["req_0"].generated_ids == reference(base, adapters, "attn-r8", prompt)[0]
    assert sync["req_1"].generated_ids == planned_ahead["req_1"].generated_ids


class _CaptureCounts:
    """A capture strategy for CPU: each captured forward (PaddedDecode's partial of its size and whether it is the
    adapted one) runs as it is, its steps counted."""

    def __init__(self) -> None:
        self.replays: Counter[tuple[int, bool]] = Counter()

    def __call__(self, forward: StepFn) -> StepFn:
        assert isinstance(forward, functools.partial)
        size, adapted = forward.args

        def step() -> torch.Tensor:
            self.replays[size, adapted] += 1
            return forward()

        return step


@needs_kernel
def test_decode_steps_with_adapters_replay_graphs_of_their_own(base: Path, adapters: dict[str, Path]) -> None:
    """With decode graphs every decode step replays its size's graph: the base one without adapters, the adapted
    one (every slot's product, static slot and scaling buffers) with them, and each request equals PEFT's."""
    names: list[str | None] = [None, "attn-r8", "mlp-r4", "qv-r16-rslora", "ko-r6"]
    prompt = [5, 77, 12, 301, 44, 9, 160]
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=4, attention_backend="cpu", page_size=4,
                             max_num_seqs=8, debug_checks=True)  # fmt: skip
    capture = _CaptureCounts()
    with EngineCore(config) as engine:
        engine.runner.use_decode_graphs(graph_sizes(max_graph_size(config)), capture)
        alone = generate_batch([prompt], params=SamplingParams(max_new_tokens=MAX_NEW), engine=engine)
        mixed = generate_batch([prompt] * len(names), params=SamplingParams(max_new_tokens=MAX_NEW), engine=engine,
                               loras=[None if n is None else lora_request(adapters, n) for n in names])  # fmt: skip
        assert engine.is_idle_and_clean()
    assert alone["req_0"].generated_ids == reference(base, adapters, None, prompt)[0]
    for i, name in enumerate(names):
        assert mixed[f"req_{i}"].generated_ids == reference(base, adapters, name, prompt)[0], name
    base_replays = sum(n for (_, adapted), n in capture.replays.items() if not adapted)
    adapted_replays = sum(n for (_, adapted), n in capture.replays.items() if adapted)
    assert base_replays >= MAX_NEW - 1, "the base request alone decodes through the base graphs"
    assert adapted_replays >= MAX_NEW - 1, "the mixed batch decodes through the adapted graphs"
    assert {size for size, adapted in capture.replays if adapted} == {8}, "five sequences padded to 8"


def test_tensor_parallel_ranks_shard_the_adapters_as_their_layers(base: Path, adapters: dict[str, Path]) -> None:
    """At TP=2 column-parallel layers keep A whole and their rows of B (per q, k, v, gate and up), row-parallel ones
    their columns of A and B whole: each adapter's tokens equal PEFT's."""
    prompt = [8, 16, 32, 64, 128, 256, 3]
    config = EngineConfig.of(model=str(base), enable_lora=True, max_loras=4, tensor_parallel_size=2)
    names = ["all-r16", "ko-r6", "qv-r16-rslora"]
    with EngineCore(config) as engine:
        out = generate_batch([prompt] * 4, params=SamplingParams(max_new_tokens=MAX_NEW), engine=engine,
                             loras=[None, *(lora_request(adapters, n) for n in names)])  # fmt: skip
    for i, name in enumerate([None, *names]):
        assert out[f"req_{i}"].generated_ids == reference(base, adapters, name, prompt)[0], name


def test_a_quantized_layer_adds_the_adapters_product_to_its_own() -> None:
    """The slots add to whatever the layer's method computes: an int8 base gets exactly its own output plus the
    low-rank product of each token's adapter (0 for a base token)."""
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    torch.manual_seed(0)
    method = quantized_linear_method(ModelConfig(path="unused", quantization="int8"), torch.device("cpu"))
    assert method is not None
    layer = ColumnParallelLinear(32, 48, bias=False, method=method)
    layer.weight_loader("weight", torch.randn(48, 32))
    slots = LoRALayer(layer, [None], num_slots=3, rank=8, device=torch.device("cpu"), dtype=torch.float32)
    a, b = torch.randn(2, 32), torch.randn(48, 2)  # rank 2 in slots of 8
    slots.load(1, {None: (a, b)})
    x = torch.randn(5, 32)
    batch = LoRABatch.of(torch.tensor([1, -1, 1, 0, 1]).numpy(), torch.tensor([0.0, 2.5, 0.0]).numpy(), 8,
                         torch.device("cpu"), torch.float32)  # fmt: skip
    assert batch is not None and batch.num_slots == 2
    expected = layer.method.apply(layer, x, None)
    expected[[0, 2, 4]] += 2.5 * (x[[0, 2, 4]] @ a.t() @ b.t())
    for add in (slots.add_per_token, slots.add_masked):  # the CPU kernel, and torch's matmuls (CUDA's way)
        out = layer.method.apply(layer, x, None)
        add(x, out, batch)
        torch.testing.assert_close(out, expected)
    none = torch.tensor([-1, -1]).numpy()
    assert LoRABatch.of(none, torch.zeros(3).numpy(), 8, torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("rank", [8, 16, 24])
def test_the_kernel_computes_each_tokens_own_product(rank: int) -> None:
    """Slots of 8, 16 and 24 ranks (the kernel's two register widths), adapters of smaller ranks in them, tokens
    spread over the slots in runs longer and shorter than its blocks, an output width with a partial last chunk."""
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    torch.manual_seed(rank)
    layer = ColumnParallelLinear(48, 72, bias=False, method=UnquantizedLinearMethod())
    layer.weight_loader("weight", torch.randn(72, 48))
    slots = LoRALayer(layer, [None], num_slots=3, rank=rank, device=torch.device("cpu"), dtype=torch.float32)
    pairs = [(torch.randn(r, 48), torch.randn(72, r)) for r in (rank, rank - 3, 1)]
    for slot, pair in enumerate(pairs):
        slots.load(slot, {None: pair})
    token_slots = torch.randint(-1, 3, (37,))
    scalings = torch.tensor([0.5, 2.0, 1.5])
    batch = LoRABatch.of(token_slots.numpy(), scalings.numpy(), rank, torch.device("cpu"), torch.float32)
    assert batch is not None
    x = torch.randn(37, 48)
    out = torch.zeros(37, 72)
    slots.add_per_token(x, out, batch)
    expected = torch.zeros(37, 72, dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            a, b = pairs[slot]
            expected[t] = scalings[slot].double() * (x[t].double() @ a.double().t() @ b.double().t())
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_the_kernel_and_the_matmuls_agree_in_bfloat16() -> None:
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels cannot be built here")
    torch.manual_seed(1)
    layer = ColumnParallelLinear(64, 40, bias=True, method=UnquantizedLinearMethod(), dtype=torch.bfloat16)
    layer.weight_loader("weight", torch.randn(40, 64))
    layer.weight_loader("bias", torch.randn(40))
    slots = LoRALayer(layer, [None], num_slots=2, rank=8, device=torch.device("cpu"), dtype=torch.bfloat16)
    slots.load(0, {None: (torch.randn(8, 64), torch.randn(40, 8))})
    slots.load(1, {None: (torch.randn(3, 64), torch.randn(40, 3))})
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    batch = LoRABatch.of(torch.tensor([0, 1, -1, 1, 0, 0]).numpy(), torch.tensor([0.5, 2.0]).numpy(), 8,
                         torch.device("cpu"), torch.bfloat16)  # fmt: skip
    assert batch is not None
    outs = []
    for add in (slots.add_per_token, slots.add_masked):
        out = layer(x)
        add(x, out, batch)
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=0.25)
    assert not torch.equal(outs[0], layer(x).float())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_adapters_on_a_quantized_base_equal_peft_on_the_weights_it_multiplies_by(
    base: Path, adapters: dict[str, Path], scheme: str
) -> None:
    """The oracle of a quantized base (tests/quantized_reference.py: transformers' model holding the dequantized
    weights) with PEFT's adapter on top, teacher-forced on Ferry's tokens."""
    prompts, max_new = prompts_for(384, shared_prefix=8)
    names = ["all-r16", "mlp-r4", None, "ko-r6"]
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    config = EngineConfig.of(model=str(base), quantization=scheme, quantization_group_size=32, enable_lora=True,
                             max_loras=3)  # fmt: skip
    with EngineCore(config) as engine:
        params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
        loras = [None if name is None else lora_request(adapters, name) for name in chosen]
        results = generate_batch(prompts, params=params, engine=engine, loras=loras)
        for name in set(chosen):
            dequantized = reference_model(base, engine.runner.model, scheme)
            reference = dequantized if name is None else PeftModel.from_pretrained(dequantized, adapters[name]).eval()
            rows = [i for i, c in enumerate(chosen) if c == name]
            picked = {f"req_{k}": results[f"req_{i}"] for k, i in enumerate(rows)}
            check_against(reference, [prompts[i] for i in rows], picked, f"{scheme} + {name}", tolerance_of(scheme))
