"""The model card (``README.md``) of an export folder, a ``huggingface_hub.ModelCard``.

Its metadata (``ModelCardData``): the base model's Hub repository as ``base_model``
(:mod:`~ondevice_moe.export.base_model`), licence, ``library_name: peft``, tags, the
run's metrics for the user as ``model-index`` (``EvalResult``), and under ``ondevice_moe``
the run, the base as the recipe named it (for ``smollm2-135m`` the GGUF file and its
SHA-256), the dtype it trained in and the versions. Then the text: what was exported,
each part's kind and role, how to load it in that dtype, and whether the PEFT adapters
are the user's model — for a mixture, why not, with the gap measured at export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ondevice_moe.export.base_model import BaseModel
from ondevice_moe.export.experts import Part
from ondevice_moe.export.mixture_gap import MixtureGap
from ondevice_moe.export.peft_format import PeftAdapter, routed_experts
from ondevice_moe.methods import Role
from ondevice_moe.names import markdown_cell, printable
from ondevice_moe.run_model import UserModel
from ondevice_moe.safe_files import write_text
from ondevice_moe.versions import versions

METRIC_NAMES = {"in": ("perplexity", "test perplexity, the user's own test split"),
                "out": ("perplexity", "test perplexity, the union of all users' test splits"),
                "score": (None, "test score on the user's own test split")}


def user_metrics(user_model: UserModel) -> dict[str, float]:
    """The run's final test metrics for the user (``summary.json``), or none when it has no summary."""
    path = user_model.job.run_dir / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text(encoding="utf-8"))
    entry = summary["methods"].get(user_model.job.method.name, {})
    values = entry.get("per_user", {}).get(user_model.user, {})
    return {key: value for key, value in values.items() if key in METRIC_NAMES}


def card_data(user_model: UserModel, base: BaseModel, name: str, metrics: dict[str, float]):
    """The card's metadata, a ``huggingface_hub.ModelCardData``."""
    from huggingface_hub import EvalResult, ModelCardData

    recipe = user_model.recipe
    task = "text-generation" if recipe.is_language_modelling else "text-classification"
    what = f"{recipe.name}: {user_model.user}" if recipe.data else f"{recipe.task.name}: {user_model.user}"
    results = [EvalResult(task_type=task, dataset_type=f"ondevice-moe/{recipe.name}", dataset_name=what,
                          metric_type=METRIC_NAMES[key][0] or recipe.metric, metric_name=METRIC_NAMES[key][1],
                          metric_value=value) for key, value in metrics.items()]
    weights = {"name": base.name, "source": base.source, "dtype": recipe.model.dtype}
    if base.sha256:
        weights["sha256"] = base.sha256
    return ModelCardData(
        base_model=base.hub_id, license=base.license, library_name="peft", pipeline_tag=task,
        tags=["ondevice-moe", "federated-learning", "flower", "mixture-of-experts", "lora", user_model.job.method.name],
        model_name=name if results else None, eval_results=results or None,
        ondevice_moe={"method": user_model.job.method.name, "user": user_model.user, "device": user_model.device,
                      "rounds": recipe.federation.rounds, "devices": len(recipe.user_names), "seed": recipe.seed,
                      "base_model": weights, "versions": versions()},
    )


def model_card(user_model: UserModel, parts: dict[str, Part], selected: dict[str, Part], adapters: list[PeftAdapter],
               toolkit: bool, gap: MixtureGap | None, base: BaseModel, name: str, pushed: bool):
    """The card, a ``huggingface_hub.ModelCard`` (``toolkit``: the folder holds the toolkit's format
    too; ``pushed``: ``name`` is the Hub repository the folder goes to)."""
    from huggingface_hub import ModelCard

    recipe, method = user_model.recipe, user_model.job.method
    metrics = user_metrics(user_model)
    rows = "\n".join(f"| `{p.name}` | {p.kind} | {p.role.value} | {'yes' if p.name in selected else 'no'} |"
                     for p in parts.values())
    lines = [
        f"# {markdown_cell(name)}\n",
        f"User **{markdown_cell(user_model.user)}**'s model of method **{method.name}** (device {user_model.device}), "
        f"fine-tuned with [ondevice-moe](https://pypi.org/project/ondevice-moe/) through Flower: recipe "
        f"`{recipe.name}`, {_count(recipe.federation.rounds, 'round')}, {len(recipe.user_names)} devices, "
        f"seed {recipe.seed}, base model `{base.name}` ({base.source}"
        + (f"; SHA-256 `{base.sha256}`" if base.sha256 else "") + f"), trained in {recipe.model.dtype}.\n",
        "## Parts\n",
        "Shared parts travelled between devices through the server; private parts never left the user's device.\n",
        "| part | kind | role | exported |\n| --- | --- | --- | --- |\n" + rows + "\n",
        _privacy_note(parts, selected),
        _metrics_text(metrics),
        _loading_text(user_model, base, adapters, toolkit, name if pushed else "path/to/this/folder", pushed),
        _mixture_text(method.name, parts, gap, adapters),
        "## Recipe\n",
        _fenced((user_model.job.run_dir / "recipe.yaml").read_text(encoding="utf-8").rstrip(), "yaml"),
    ]
    text = printable("\n".join(line for line in lines if line), keep_newlines=True)
    return ModelCard(f"---\n{card_data(user_model, base, name, metrics).to_yaml()}\n---\n\n{text}")


def _fenced(text: str, language: str) -> str:
    """``text`` as a Markdown code block whose fence is longer than any run of backticks in it, so the
    text cannot close the block and bring its own Markdown or HTML into the card."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}\n"


def _privacy_note(parts: dict[str, Part], selected: dict[str, Part]) -> str:
    private = [name for name, part in parts.items() if part.role is Role.PRIVATE]
    if not private:
        return ""
    exported = [name for name in private if name in selected]
    if exported:
        return (f"**Private parts included** ({', '.join(exported)}): they are the user's own, trained on the "
                "user's data only, and were exported on request (`--experts all`).\n")
    return (f"Private parts ({', '.join(private)}) are the user's own and were left out (export them with "
            "`--experts all`); loaded, they keep their initial values, so this is not the user's whole model.\n")


def _metrics_text(metrics: dict[str, float]) -> str:
    if not metrics:
        return ""
    rows = "\n".join(f"| {METRIC_NAMES[key][1]} | {value:.4g} |" for key, value in metrics.items())
    return f"## Metrics (the run's, for this user)\n\n| metric | value |\n| --- | --- |\n{rows}\n"


def _loading_text(user_model: UserModel, base: BaseModel, adapters: list[PeftAdapter], toolkit: bool, where: str,
                  pushed: bool) -> str:
    """How to load the folder, in the dtype the run trained in (``where``: the folder or Hub repository)."""
    recipe = user_model.recipe
    dtype = recipe.model.dtype
    labels = "" if recipe.is_language_modelling else f", num_labels={recipe.task.spec().num_labels}"
    text = "## Loading\n"
    if toolkit:
        download = (f"from huggingface_hub import snapshot_download\n\nfolder = snapshot_download(\"{where}\")\n"
                    if pushed else f"folder = \"{where}\"\n")
        text += ("\nThe exported parts, routers included, with the toolkit (the base as the run loaded it, "
                 f"in {dtype}):\n\n```python\nimport ondevice_moe\n{download}"
                 "model = ondevice_moe.load_adapted(None, folder)  # or pass your base model\n```\n")
    if not adapters:
        return text
    if len(adapters) == 1:
        what, path = "The PEFT adapter", f'"{where}"'
    else:
        what = f"Each PEFT adapter ({', '.join(a.name for a in adapters)}: one expert each, with the attention LoRA)"
        path = f'"{where}", subfolder="{adapters[0].name}"' if pushed else f'"{where}/{adapters[0].name}"'
    # AutoPeftModel passes `subfolder` on to the base's from_pretrained: it loads an adapter at the top only.
    auto_loads = base.name_or_path is not None and (len(adapters) == 1 or not pushed)
    if auto_loads:
        auto = "AutoPeftModelForCausalLM" if recipe.is_language_modelling else "AutoPeftModelForSequenceClassification"
        text += (f"\n{what} names its base, `{base.name_or_path}`, and loads it:\n\n```python\nimport torch\n"
                 f"from peft import {auto}\n\n"
                 f"model = {auto}.from_pretrained({path}{labels}, dtype=torch.{dtype})\n```\n")
        if base.sha256 is None:
            return text
        text += f"\nThat base is the Hub's; the run trained on {base.source}. On that exact base:\n"
    else:
        text += f"\n{what}, on the run's base:\n"
    return text + ("\n```python\nfrom peft import PeftModel\nfrom ondevice_moe.models import load_base_model\n\n"
                   f'base = load_base_model("{base.name}", dtype="{dtype}"{labels}).model\n'
                   f"model = PeftModel.from_pretrained(base, {path})\n```\n")


def _mixture_text(method: str, parts: dict[str, Part], gap: MixtureGap | None, adapters: list[PeftAdapter]) -> str:
    """Whether the PEFT adapters are the user's model; for a mixture, why not, with the gap measured at export."""
    routed = routed_experts(parts)
    names = ", ".join(routed)
    if adapters and adapters[0].merged:
        merged = (f"{method} adds its {len(routed)} experts ({names}) with fixed weights, and the PEFT adapter "
                  "holds them merged at those weights: one LoRA per layer, the experts' ranks side by side")
        if adapters[0].exact:
            return merged + ". That is exactly the user's model: the experts share each layer they adapt.\n"
        text = ("## A mixture of MLP experts has no exact PEFT form\n\n" + merged + ". The model's MLP output is "
                "Σ_j w_j MLP_j(x), and each expert's MLP runs the nonlinearity between its own input and output "
                "LoRAs, so no LoRA on the MLP's layers equals it: the adapter is the closest PEFT form, and "
                "`load_adapted` gives the user's model exactly.\n")
        return text + _gap_table(gap, average_only=True)
    if len(routed) < 2:
        return "The PEFT adapter holds the whole adapted model: no router mixes experts.\n" if adapters else ""
    text = ("## A routed mixture has no exact PEFT form\n\n"
            f"{method} mixes {len(routed)} experts ({names}) through its router. PEFT adapters are "
            "on or off for the whole input, and summing or averaging the experts' LoRA updates is not the "
            "routed model: use `load_adapted` for the user's model")
    text += f"; each PEFT adapter ({', '.join(a.name for a in adapters)}) holds one expert.\n" if adapters else ".\n"
    return text + _gap_table(gap, average_only=False)


def _gap_table(gap: MixtureGap | None, average_only: bool) -> str:
    if gap is None:
        return ""
    average = "the PEFT adapter: experts merged" if average_only else "experts averaged"
    text = (f"\nMeasured at export on {gap.blocks} of this user's test blocks, against the experts merged: one "
            "LoRA update Σ w_j ΔW_j in every MLP layer, the attention LoRA as it is:\n\n"
            "| model | mean abs. logit difference to the trained model | perplexity |\n| --- | --- | --- |\n"
            f"| trained (this export, `load_adapted`) | 0 | {gap.perplexity_routed:.4g} |\n"
            f"| {average} (w = 1/{gap.experts}) | {gap.logit_gap_average:.4g} | {gap.perplexity_average:.4g} |\n")
    if not average_only:
        text += f"| experts summed (w = 1) | {gap.logit_gap_sum:.4g} | {gap.perplexity_sum:.4g} |\n"
    return text


def write_model_card(folder: Path, card) -> Path:
    """Save ``card`` as ``folder/README.md``."""
    path = folder / "README.md"
    write_text(path, str(card))
    return path


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"
