"""LLM: the offline entry point. generate() and chat() drive LLMEngine.step() until every request is done; LLM owns
its engine's configuration life (engine/reconfigure.py), so update_config changes it between two of those steps."""
from __future__ import annotations

import random

from .config import LOAD_TIME_FIELDS, WEIGHT_FIELDS, EngineConfig
from .engine import LLMEngine
from .factory import TORCH_DTYPES, resolve_device, resolve_weights, stored_as
from .models import LlamaFamilyModel, load_model
from .models.loader import load_weights
from .models.random_models import random_name
from .quant.format import WeightFormat
from .reconfigure import Reconfiguration
from .request import RequestOutput
from .sampling_params import SamplingParams
from .utils import TOKEN_RANGE, chat_token_ids


def engine_for(requested: EngineConfig, model: LlamaFamilyModel, tokenizer, hf_config=None) -> LLMEngine:
    """An engine for `requested` (as asked: "auto" and None kept, and reported so) over a loaded model: the factory
    decides the dtype for the model's device, and the engine's other automatic fields as it resolves them."""
    return LLMEngine(resolve_weights(requested, model.device), model, tokenizer, hf_config, requested=requested)


def warm_up(engine: LLMEngine) -> None:
    """One tiny greedy request run to the end, so what follows does not pay first-call costs (and a
    configuration that builds but cannot run a step fails here, not on someone's request)."""
    rng = random.Random(-1)
    engine.add_request([rng.randrange(*TOKEN_RANGE) for _ in range(8)],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


class LLM:
    def __init__(self, model: str | None = None, **config_fields) -> None:
        requested = EngineConfig.from_kwargs(model=model, **config_fields)
        device = resolve_device(requested.device)
        self.config = resolve_weights(requested, device)  # as loaded: the dtype decided (the engine keeps "auto")
        net, tokenizer, hf_config, folder = load_model(model, TORCH_DTYPES[self.config.dtype], device,
                                                       self.config.max_model_len, WeightFormat.of(self.config))
        self.model_path = folder
        self.tokenizer = tokenizer
        self.engine = engine_for(requested, net, tokenizer, hf_config)
        self._variant: tuple[tuple, LlamaFamilyModel] | None = None
        self._reconfig: Reconfiguration | None = None

    # ---- the engine's configuration, changed between two of its steps -------------------------------------------
    @property
    def reconfig(self) -> Reconfiguration:
        """Begun again when another owner (a service, a rebuild that replaced self.engine) has changed the engine."""
        if self._reconfig is None or self._reconfig.current is not self.engine.config:
            self._reconfig = Reconfiguration.of(self.engine)
        return self._reconfig

    def update_config(self, **changes) -> None:
        """Validate now (ValueError leaves everything as it was); apply at the next step boundary (step(), and so
        generate()): a change to the KV pool's structure re-prefills the running requests, nothing is lost."""
        self.reconfig.update(changes, self.engine)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0) -> str:
        """The engine's add_request, the request checked also against a change waiting to apply."""
        self.reconfig.check_request(prompt, params, priority)
        return self.engine.add_request(prompt, params, request_id, arrival_time, priority)

    def step(self) -> list[RequestOutput]:
        """One engine step, a waiting configuration change carried out first (only ever between two steps)."""
        self.reconfig.apply(self.engine)
        return self.engine.step()

    # ---- every engine over this checkpoint (the benchmarks', the playground's rebuilds), through engine_for ----
    def config_for(self, fields: dict) -> EngineConfig:
        """EngineConfig for an engine over this checkpoint: the model and device must be the loaded ones; the
        weights' dtype and quantization (WEIGHT_FIELDS) may differ (build_engine then loads that variant once)."""
        fields = dict(fields)
        for name in LOAD_TIME_FIELDS:
            loaded = getattr(self.config, name)
            if name in WEIGHT_FIELDS:
                fields.setdefault(name, loaded)
            elif name in fields and fields[name] != loaded:
                raise ValueError(f"{name}={fields[name]!r} differs from the loaded model's {name}={loaded!r}: "
                                 f"the checkpoint is loaded once, so give it with --model / --set for the whole run")
            else:
                fields[name] = loaded
        return EngineConfig.from_kwargs(**fields)

    def build_engine(self, fields: dict) -> LLMEngine:
        """A fresh engine with these fields over this checkpoint's weights (loaded in another format once if the
        fields ask for one: weights_for). Nothing of this LLM's own engine changes."""
        requested = self.config_for(fields)
        return engine_for(requested, self.weights_for(requested), self.tokenizer, self.engine.hf_config)

    def weights_for(self, config: EngineConfig) -> LlamaFamilyModel:
        """The model with config's dtype and quantization (WEIGHT_FIELDS), over the same checkpoint, device and
        RoPE length: the loaded one when they agree, else loaded once from the same folder and kept (one variant
        at a time, so comparing two precisions holds two models, not one per configuration tried)."""
        config = resolve_weights(config, self.engine.model.device)
        key = (config.dtype, WeightFormat.of(config))
        if key == stored_as(self.engine.model):  # the engine's own (after a rebuild, maybe not self.config's)
            return self.engine.model
        if self._variant is None or self._variant[0] != key:
            self._variant = None  # let the previous variant go before loading the next
            self._variant = (key, self.load_weights(config))
        return self._variant[1]

    def load_weights(self, config: EngineConfig) -> LlamaFamilyModel:
        """A fresh copy of the model with config's dtype and quantization (not kept: see weights_for)."""
        loaded = self.engine.model
        dtype = TORCH_DTYPES[resolve_weights(config, loaded.device).dtype]
        if random_name(str(self.model_path)) is not None:  # the same seeded weights, in another format
            return load_model(str(self.model_path), dtype, loaded.device, loaded.max_len, WeightFormat.of(config))[0]
        return load_weights(self.model_path, self.engine.hf_config, dtype, loaded.device,
                            loaded.max_len, WeightFormat.of(config))

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
        except ValueError:
            for rid in ids:  # a bad prompt rejects the whole call; other requests in flight are untouched
                self.engine.abort(rid)
            raise
        mine = set(ids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in mine:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        if not messages:
            raise ValueError("empty conversation")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], params)
