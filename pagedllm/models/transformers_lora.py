"""LoRA adapters on the Transformers backend: its decoder's unfused projections as ``LoRALinear`` pieces.

A Llama / Qwen2 / Mistral-style ``transformers`` decoder layer holds ``self_attn.q_proj`` ...
``o_proj`` and ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``, one linear each (PEFT's target
names). ``TransformersLoRAMixin.lora_layer_specs`` names them for ``models.lora_linear.install_lora``,
one piece per linear, whatever module serves the base (``nn.Linear``, oneDNN-packed, GGUF blocks or
int8 of ``packed_transformers``: the wrapper adds the delta to its output). A projection is wrapped
only where every decoder layer has it and the config names it (``lora.checker.text_model_shapes``:
an MoE model's MLPs are experts, not wrapped); an adapter targeting another is refused by
``peft_reader.check_shapes``, by name.
``TransformersCausalLM.forward`` sets the step's ``LoRAStep`` in ``lora_context`` (its ``lora``
keyword) and keeps such steps off the batch-1 C decode stack, which would bypass the wrappers.
"""

from __future__ import annotations

from torch import nn

from pagedllm.lora.checker import text_model_shapes
from pagedllm.models.lora_linear import LayerSpec

PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
               ("mlp", ("gate_proj", "up_proj", "down_proj")))


def decoder_layers(hf: nn.Module) -> nn.ModuleList:
    """The decoder layers of a ``transformers`` causal LM (``get_decoder().layers``: ``model.layers``,
    a vision-language model's ``language_model.layers``).

    Raises:
        ValueError: the model has no such list.
    """
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else getattr(hf, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"enable_lora: {type(hf).__name__} has no decoder layers (get_decoder().layers)")
    return layers


def layer_specs(hf: nn.Module, text_config) -> list[list[LayerSpec]]:
    """Per decoder layer, ``(owner, attribute, [(projection, 0, out)], in)`` of each projection every
    layer has; ``out`` / ``in`` from the text config (``lora.checker.text_model_shapes``, the front
    end's check), matched against the module's ``out_features`` / ``in_features`` where it has them.

    Raises:
        ValueError: no layer list, a layer count or module width other than the config's, or no
            projection of ``PROJECTIONS`` in every layer.
    """
    shapes, num_layers = text_model_shapes(text_config)
    layers = decoder_layers(hf)
    if len(layers) != num_layers:
        raise ValueError(f"enable_lora: {type(hf).__name__} has {len(layers)} decoder layers, its config "
                         f"{num_layers}")
    owned = [(part, name) for part, names in PROJECTIONS for name in names if name in shapes
             and all(isinstance(getattr(getattr(layer, part, None), name, None), nn.Module) for layer in layers)]
    if not owned:
        raise ValueError(f"enable_lora: {type(hf).__name__}'s decoder layers have none of the projections "
                         f"{[n for _, names in PROJECTIONS for n in names]} (a LoRA adapter's targets)")
    specs = []
    for i, layer in enumerate(layers):
        row = []
        for part, name in owned:
            owner, (out, inp) = getattr(layer, part), shapes[name]
            mod = getattr(owner, name)
            if (getattr(mod, "out_features", out), getattr(mod, "in_features", inp)) != (out, inp):
                raise ValueError(f"enable_lora: layer {i} {part}.{name} is {mod.out_features}x{mod.in_features}, "
                                 f"the config says {out}x{inp}")
            row.append((owner, name, [(name, 0, out)], inp))
        specs.append(row)
    return specs


class TransformersLoRAMixin:
    """``TransformersCausalLM``'s side of ``models.lora_linear`` (``lora_layer_specs``, ``lora_context``)."""

    lora_context = None  # a ``LoRAContext`` once ``install_lora`` ran (enable_lora)

    def lora_layer_specs(self) -> list[list[LayerSpec]]:
        """The linears ``install_lora`` wraps (``layer_specs`` of the wrapped ``transformers`` model)."""
        cfg = self.hf.config
        return layer_specs(self.hf, cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)
