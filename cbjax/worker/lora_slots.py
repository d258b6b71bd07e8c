"""Which LoRA adapter each device slot holds, and the adapters read on the host (vLLM's LoRA manager).

Slot 0 is the base model (no factors); slots 1..max_loras hold adapters (row slot - 1 of each
projection's arrays). A step's rows name their adapters; one not resident takes a free slot, else the
least recently used slot whose adapter no row of this step uses (the scheduler admits at most max_loras adapters among running
requests, so there is one). Writing a slot changes only array values: the host keeps a copy of every
slot array, and the changed arrays are put on the device whole before the step (no program is
compiled). A step still running keeps the arrays it was launched with. Adapters read from disk stay
on the host, least recently used first out, up to max_cpu_loras.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from cbjax.lora.peft import LoRAAdapter, read_peft_adapter
from cbjax.lora.request import LoRARequest
from cbjax.models.layers.lora import lora_modules
from cbjax.worker.weight_stacks import WeightStacks


@dataclasses.dataclass
class _SlotArrays:
    """One LoRA projection: its layer, parts, and host copies of its a and each part's b, with each
    array's index among a step's weights."""

    layer: int
    parts: tuple[tuple[str, int], ...]
    arrays: list[np.ndarray]  # a [parts, slots, rank, in], then b [slots, rank, part_out] per part
    indices: list[int]


class LoRASlotTable:
    """The runner's LoRA state: adapters on the host (`add`, `remove`), which slot holds which
    (`step_slots`), and the host copies of every slot array, put on the device before a step (`put`)."""

    def __init__(self, model: nnx.Module, weight_stacks: WeightStacks, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None):
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        # A LoRA array's place among the step's weights: its place in the flat state, kept by WeightStacks
        # (only vectors are stacked).
        flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
        key = lambda k: getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))  # noqa: E731 (dict, list, attribute)
        paths = {tuple(map(key, path))[:-1]: index for index, (path, _) in enumerate(flat)}  # (without the trailing .value)
        step_index = {entry: position for position, entry in enumerate(weight_stacks.entries) if isinstance(entry, int)}
        modules = {id(module): tuple(path) for path, module in nnx.iter_modules(model)}
        self.projections = []
        for layer, slots in lora_modules(model):
            names = [("a",), *(("b", j) for j in range(len(slots.parts)))]
            self.projections.append(_SlotArrays(
                layer, slots.parts, [np.zeros(w.shape, w.dtype) for w in (slots.a, *slots.b)],  # (attach_lora's zeros)
                [step_index[paths[(*modules[id(slots)], *name)]] for name in names]))
        if not self.projections:
            raise ValueError("enable_lora: the model has no LoRA projections; build it with attach_lora first")
        # (layer, checkpoint projection) -> (in, out): what an adapter's factors must match.
        self.shapes = {(p.layer, part): (p.arrays[0].shape[3], width) for p in self.projections for part, width in p.parts}
        self.adapters: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()  # host cache, LRU first
        self.resident: collections.OrderedDict[int, int] = collections.OrderedDict()  # lora_int_id -> slot, LRU first
        self.dirty = False  # host copies changed since the device's were put

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter `request` names, read (and checked) if the host does not hold it; ValueError if bad."""
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is not None and adapter.request != request:
            raise ValueError(f"lora_int_id={request.lora_int_id} is adapter {adapter.request.lora_name!r} "
                             f"({adapter.request.lora_path}); give {request.lora_name!r} an id of its own")
        if adapter is None:
            adapter = read_peft_adapter(request, self.shapes, self.max_lora_rank)
        self.adapters[request.lora_int_id] = adapter
        self.adapters.move_to_end(request.lora_int_id)
        while len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter on the host and its slot (a request still running under it reads it again
        when its row is next prepared); False if unknown."""
        self.resident.pop(lora_int_id, None)
        return self.adapters.pop(lora_int_id, None) is not None

    def step_slots(self, lora_requests: Sequence[LoRARequest | None]) -> list[int]:
        """Each row's slot (0: no adapter), making the adapters resident that are not."""
        wanted = {request.lora_int_id: request for request in lora_requests if request is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step names {len(wanted)} LoRA adapters; max_loras={self.max_loras} fit on the device "
                               "(a scheduler bug: report it)")
        for lora_int_id, request in wanted.items():
            if lora_int_id in self.resident:
                self.resident.move_to_end(lora_int_id)
            else:
                self._activate(self.add(request), set(wanted))
        return [0 if request is None else self.resident[request.lora_int_id] for request in lora_requests]

    def _activate(self, adapter: LoRAAdapter, in_step: set[int]) -> None:
        taken = set(self.resident.values())
        free = [slot for slot in range(1, self.max_loras + 1) if slot not in taken]
        if free:
            slot = free[0]
        else:
            evicted = next(lora_int_id for lora_int_id in self.resident if lora_int_id not in in_step)
            slot = self.resident.pop(evicted)
        for projection in self.projections:
            self._write(projection, slot, adapter)
        self.resident[adapter.request.lora_int_id] = slot
        self.dirty = True

    def _write(self, projection: _SlotArrays, slot: int, adapter: LoRAAdapter) -> None:
        """Each part's factors into the slot's first r rank rows (zeros elsewhere: a lower rank, or a part not adapted)."""
        a, *bs = projection.arrays
        for j, (part, _) in enumerate(projection.parts):
            a[j, slot - 1], bs[j][slot - 1] = 0, 0
            factors = adapter.factors.get((projection.layer, part))
            if factors is not None:
                rank = factors[0].shape[0]
                a[j, slot - 1, :rank], bs[j][slot - 1, :rank] = factors

    def put(self, step_weights: list[jax.Array]) -> None:
        """Replace the step's LoRA arrays with the host's copies if any slot changed (new arrays: a step
        launched before keeps its own)."""
        if not self.dirty:
            return
        for projection in self.projections:
            for index, host in zip(projection.indices, projection.arrays):
                step_weights[index] = jax.device_put(host.astype(step_weights[index].dtype), step_weights[index].sharding)
        self.dirty = False
