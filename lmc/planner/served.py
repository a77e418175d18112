"""What the plan serves beside the base weights (LoRA adapters, a speculative proposer): the refusal of the
engines that cannot, and the plan's `lora` and `speculative` sections with their decisions. The math is in
lmc.planner.lora and lmc.planner.speculative; vllm_memory and vllm_predict read it through the model."""

from __future__ import annotations

from lmc.planner.facts import EngineFacts, HardwareFacts, ModelFacts
from lmc.planner.lora import lora_reason, lora_section, lora_step_ms
from lmc.planner.memory import compute_dtype
from lmc.planner.plan import Decision, LoraSection, Plan, SpeculativeSection
from lmc.planner.speculative import speculative_reason, speculative_section
from lmc.planner.vllm import VllmLayout, decode_context, layout_steps, plain_decode_ms, running_sequences


def refusal(engine: str, model: ModelFacts) -> str | None:
    """Why `engine` cannot serve the spec's adapters or speculation (only vLLM can), else None."""
    if engine == "vllm":
        return None
    asked = [(what, flag) for what, flag, present in (
        ("LoRA adapters ([[adapters]])", "--enable-lora", model.adapters),
        ("speculative decoding ([speculative])", "--speculative-config", model.speculative)) if present]
    if not asked:
        return None
    verb = "needs" if [what for what, _ in asked] == ["speculative decoding ([speculative])"] else "need"
    return (f"{engine}: {' and '.join(what for what, _ in asked)} {verb} vLLM "
            f"({', '.join(flag for _, flag in asked)}); lmc's {engine} engine serves the base model alone")


def with_served_extras(plan: Plan, model: ModelFacts, hardware: HardwareFacts, engine: EngineFacts,
                       layout: VllmLayout | None, replicas: int, input_tokens: int, output_tokens: int,
                       concurrency: int) -> Plan:
    """`plan` with its lora and speculative sections and decisions (a vLLM plan whose spec asks for them)."""
    if layout is None or not (model.adapters or model.speculative):
        return plan
    tp, dp = plan.tensor_parallel_degree, layout.data_parallel_size
    running = running_sequences(layout.max_num_seqs, replicas * dp, concurrency)
    act = compute_dtype(plan.dtype, model, hardware)
    update: dict = {}
    decisions = list(plan.decisions)
    lora = lora_section(model, layout.max_num_seqs, act, tp)
    if lora is not None:
        step = lora_step_ms(model, hardware, engine, plan.dtype, tp, running, layout.max_num_seqs, dp)
        update["lora"] = LoraSection(**lora)
        decisions.append(Decision(key="lora", value=f"{len(model.adapters)} adapter(s)",
                                  reason=lora_reason(model, lora, step, running)))
    steps = layout_steps(model, hardware, engine, plan.dtype, tp, layout)
    context = decode_context(input_tokens, output_tokens)

    def plain_at(batch: int) -> float:  # vllm_predict's decode step at `batch`, before speculation
        return plain_decode_ms(steps, model, hardware, engine, plan.dtype, tp, layout, batch, context)

    speculative = speculative_section(model, hardware, engine, plan.dtype, tp, running, layout.max_num_seqs,
                                      input_tokens, output_tokens, dp, plain_at)
    if speculative is not None:
        update["speculative"] = SpeculativeSection(**speculative)
        decisions.append(Decision(key="speculative",
                                  value=speculative["method"] if speculative["enabled"] else "off",
                                  reason=speculative_reason(speculative)))
    return plan.model_copy(update={**update, "decisions": decisions})
