"""Load what counting needs from a HF processor: tokenizer, chat template, media settings.

``AutoProcessor`` is tried first. In transformers 5.x the Qwen-VL processors refuse to load
without a video processor, and every HF video processor needs torchvision, which CPU-only
torch installs often lack. Counting needs no video processor, so on that failure the pieces
are loaded directly (tokenizer, PIL image processor, chat template, video config as JSON)
and the fallback is logged once. The processor identity (class + hash of every setting that
shapes token ids) goes into the manifest.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoProcessor, AutoTokenizer, ProcessorMixin
from transformers.image_processing_utils import ImageProcessingMixin

# from its module: transformers 5.8 - 5.12 export a torchvision-gated placeholder at the top level
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.utils import IMAGE_PROCESSOR_NAME, VIDEO_PROCESSOR_NAME, cached_file, is_torchvision_available

from packvlm.errors import UsageError

log = logging.getLogger(__name__)


class ProcessorLoadError(UsageError):
    """The processor path cannot give a tokenizer + chat template; says what to fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessorBundle:
    """Everything a worker needs to count and (optionally) verify against the real processor."""

    source: str
    processor_class: str
    tokenizer: Any
    image_processor: Any
    video_config: dict[str, Any]
    chat_template: str
    processor: ProcessorMixin | None  # the real processor, if it could be built here
    loaded_via: str  # "AutoProcessor" or "pieces"
    # processor_config.json's settings (e.g. Pixtral's patch_size, spatial_merge_size)
    processor_config: dict[str, Any] = field(default_factory=dict)
    # preprocessor_config.json as written, hashed in `identity` instead of the loaded image processor
    # where that processor is torchvision-only (LFM2-VL): loaded with torchvision it serialises every
    # class default, without it only the file, so the identity would differ between the two
    image_config: dict[str, Any] | None = None

    def token_id(self, default_token: str, attribute: str) -> int:
        """Id of a special token, preferring the tokenizer's own attribute (e.g. image_token)."""
        token = getattr(self.tokenizer, attribute, None) or default_token
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ProcessorLoadError(f"{self.source}: tokenizer has no {token!r} token")
        return int(token_id)

    def identity(self) -> dict[str, str]:
        """Class and a hash over the tokenizer, chat template and media settings."""
        digest = hashlib.sha256()
        digest.update(self.tokenizer.backend_tokenizer.to_str().encode("utf-8"))
        digest.update(self.chat_template.encode("utf-8"))
        if self.image_config is not None:
            digest.update(json.dumps(self.image_config, sort_keys=True, default=str).encode("utf-8"))
        else:
            digest.update(self.image_processor.to_json_string().encode("utf-8"))
        digest.update(json.dumps(self.video_config, sort_keys=True, default=str).encode("utf-8"))
        if self.processor_config:  # absent for Qwen: their identities stay as they were
            digest.update(json.dumps(self.processor_config, sort_keys=True, default=str).encode("utf-8"))
        return {"class": self.processor_class, "sha256": digest.hexdigest(), "source": self.source}


NOTED_ENV = "PACKVLM_NOTED_NO_TORCHVISION"  # set once noted: processes started after inherit it


@functools.cache
def _warn_no_torchvision_once(path: str) -> None:
    """One debug note per processor and run; the warning comes where a video needs torchvision.

    Loading without torchvision changes nothing for image/text data, so no command warns at load
    time: `prep tokenize`'s summary counts the videos it could not verify ("no reference processor
    here (videos need torchvision)"), and `train` stops before it starts (exit 3, the install
    line) when its split holds a video (`train.preflight`). The driver notes it first; Ray actors
    and loader workers inherit `NOTED_ENV` and stay quiet.
    """
    if path in os.environ.get(NOTED_ENV, "").split(os.pathsep):
        return
    log.debug(
        "%s: no torchvision, so no HF video processor: loaded the tokenizer, chat template and PIL image "
        "processor directly (video counts are closed-form; verifying or training videos needs torchvision)",
        path,
    )
    os.environ[NOTED_ENV] = os.pathsep.join(filter(None, (os.environ.get(NOTED_ENV), path)))


HUB_PROBE_TIMEOUT_S = 3.0
# Files any processor repo has one of; a cached one means the HF cache holds the repo.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json", "config.json")


def _check_hub_reachable(path: str) -> None:
    """Fail at once for a hub id that cannot load: HF retries each file ~23 s when offline.

    huggingface_hub retries connection errors 5 times with backoff 1, 2, 4, 8, 8 s
    (``huggingface_hub.utils._http._http_backoff_base``) for each file transformers asks
    for, with no setting to shorten it: a wrong id without network took ~2 min before any
    message. A local directory, or a string that is not a repo id (``validate_repo_id``
    raises at once), is left to ``from_pretrained``. For a repo id: with ``HF_HUB_OFFLINE``
    set only the HF cache can serve it; otherwise one request to the endpoint without
    retries (the hub's own session, so proxies apply) tells whether the hub answers.

    Raises:
        ProcessorLoadError: Not in the cache under HF_HUB_OFFLINE, or the hub is unreachable.
    """
    from huggingface_hub import constants, get_session, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(path).expanduser().is_dir():
        return
    try:
        validate_repo_id(path)
    except HFValidationError:
        return
    cached = any(isinstance(try_to_load_from_cache(path, name), str) for name in _PROCESSOR_FILES)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise ProcessorLoadError(
            f"--processor {path!r}: no such local directory, and with HF_HUB_OFFLINE set only the Hugging Face "
            "cache is read, which has no copy of it; give the path of a processor directory"
        )
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as exc:  # httpx connect/timeout/proxy errors: any means no answer
        use_cache = " or set HF_HUB_OFFLINE=1 to load the copy in the HF cache" if cached else ""
        raise ProcessorLoadError(
            f"--processor {path!r}: no such local directory, and the Hugging Face Hub ({constants.ENDPOINT}) "
            f"does not answer ({type(exc).__name__}: {exc}); give the path of a processor directory{use_cache}"
        ) from exc


def load_processor_once(path: str) -> ProcessorBundle:
    """:func:`load_processor`, once per process for the same files (loading takes seconds).

    `prep tokenize`'s up-front check and its in-process workers, and `train`'s dataset check and
    encoder, share one bundle. Keyed by the directory's file names, sizes and mtimes, so a
    processor rewritten in place between two runs of one process loads anew.
    """
    return _load_processor_cached(path, _files_stamp(path))


@functools.lru_cache(maxsize=8)
def _load_processor_cached(path: str, stamp: tuple[tuple[str, int, int], ...]) -> ProcessorBundle:
    return load_processor(path)


def _files_stamp(path: str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of a local directory's files; empty for a hub id."""
    root = Path(path)
    if not root.is_dir():
        return ()
    stats = ((f.name, f.stat()) for f in root.iterdir() if f.is_file())
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def load_processor(path: str) -> ProcessorBundle:
    """Load a processor by local path or hub id; fall back to pieces when torchvision is missing."""
    _check_hub_reachable(path)
    try:
        processor = AutoProcessor.from_pretrained(path)
    except (ImportError, ValueError, TypeError, AttributeError) as exc:
        # without torchvision, transformers 5.8 - 5.12 may fail inside the video auto class with
        # an AttributeError that names neither
        about_video = "torchvision" in str(exc).lower() or "video" in str(exc).lower()
        if not about_video and is_torchvision_available():
            raise ProcessorLoadError(f"cannot load processor {path!r}: {exc}") from exc
        _warn_no_torchvision_once(path)
        return _load_pieces(path)
    if not isinstance(processor, ProcessorMixin):
        raise ProcessorLoadError(f"{path!r} loads a {type(processor).__name__}, not a multimodal processor")
    video = getattr(processor, "video_processor", None)
    return ProcessorBundle(
        source=str(path),
        processor_class=type(processor).__name__,
        tokenizer=processor.tokenizer,
        image_processor=processor.image_processor,
        video_config=video.to_dict() if video is not None else {},
        chat_template=_require_template(path, processor.chat_template or processor.tokenizer.chat_template),
        processor=processor,
        loaded_via="AutoProcessor",
        processor_config=_processor_settings(ProcessorMixin.get_processor_dict(path)[0]),
        image_config=_read_json(path, IMAGE_PROCESSOR_NAME) if _torchvision_only(processor.image_processor) else None,
    )


def _torchvision_only(image_processor: Any) -> bool:
    """Whether transformers maps this image processor class to a torchvision backend and no PIL one."""
    from transformers.models.auto.auto_mappings import IMAGE_PROCESSOR_MAPPING_NAMES

    if isinstance(image_processor, SettingsOnlyImageProcessor):
        return True
    name = type(image_processor).__name__
    return any(
        isinstance(backends, dict) and backends.get("torchvision") == name and "pil" not in backends
        for backends in IMAGE_PROCESSOR_MAPPING_NAMES.values()
    )


def _load_pieces(path: str) -> ProcessorBundle:
    processor_dict, _ = ProcessorMixin.get_processor_dict(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_config = _read_json(path, IMAGE_PROCESSOR_NAME)
    image_processor = _pil_image_processor(path, image_config.get("image_processor_type"))
    settings_only = isinstance(image_processor, SettingsOnlyImageProcessor)
    # Qwen-VL keep video settings beside the image ones; a torchvision-only family (LFM2-VL) takes no video
    video_config = _read_json(path, VIDEO_PROCESSOR_NAME) or ({} if settings_only else image_config)
    processor_class = processor_dict.get("processor_class") or image_config.get("processor_class") or ""
    template = _require_template(path, processor_dict.get("chat_template") or tokenizer.chat_template)
    settings = _processor_settings(processor_dict)
    return ProcessorBundle(
        source=str(path),
        processor_class=processor_class,
        tokenizer=tokenizer,
        image_processor=image_processor,
        video_config=video_config,
        chat_template=template,
        processor=None
        if settings_only
        else _image_only_processor(processor_class, image_processor, tokenizer, template, settings, video_config),
        loaded_via="pieces",
        processor_config=settings,
        image_config=image_config if settings_only else None,
    )


def _pil_image_processor(path: str, type_name: str | None) -> Any:
    """The PIL image processor of ``path``.

    ``AutoImageProcessor`` finds it, except on transformers 5.8 - 5.12 without torchvision: there
    the top-level names of several PIL classes (Idefics3, SmolVLM, ...) are torchvision-gated
    placeholders although their modules import without it, and the auto class finds no class.
    Then the class named in transformers' image-processor mapping is imported from its module.
    A class that exists only for torchvision (LFM2-VL, Kimi K2.5) has no PIL twin: without
    torchvision its settings are kept as a ``SettingsOnlyImageProcessor`` (counting reads settings).
    """
    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil")
    except (ValueError, AttributeError, ImportError) as exc:
        cls = _pil_image_processor_class(type_name) if type_name else None
        if cls is None and not is_torchvision_available():
            return _settings_only_image_processor(path)
        if cls is None:
            raise ProcessorLoadError(f"cannot load the image processor of {path!r}: {exc}") from exc
        return cls.from_pretrained(path)


class SettingsOnlyImageProcessor(ImageProcessingMixin):
    """``preprocessor_config.json`` as attributes, for a torchvision-only image processor without torchvision.

    LFM2-VL's ``Lfm2VlImageProcessor`` (and Kimi K2.5's) has no PIL twin: counting needs only its settings, which a
    family's counter reads with the class defaults it declares itself (``families/lfm2_vl``).
    It processes no pixels; the processor is not built (verifying and training need torchvision).
    """


def _settings_only_image_processor(path: str) -> SettingsOnlyImageProcessor:
    log.debug("%s: torchvision-only image processor without torchvision: its settings only (counts exact)", path)
    return SettingsOnlyImageProcessor.from_pretrained(path)


def _pil_image_processor_class(type_name: str) -> Any:
    from transformers.models.auto.auto_mappings import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    base = type_name.removesuffix("Fast").removesuffix("Pil")
    for model_type, backends in IMAGE_PROCESSOR_MAPPING_NAMES.items():
        pil = backends.get("pil") if isinstance(backends, dict) else None
        if pil is None or base not in (pil.removesuffix("Pil"), backends.get("torchvision")):
            continue
        module_name = model_type_to_module_name(model_type)
        try:
            module = importlib.import_module(f"transformers.models.{module_name}.image_processing_pil_{module_name}")
        except ImportError:
            continue
        return getattr(module, pil, None)
    return None


def _processor_settings(processor_dict: dict[str, Any]) -> dict[str, Any]:
    """processor_config.json's own settings (the chat template and class name are kept elsewhere)."""
    return {k: v for k, v in processor_dict.items() if k not in ("chat_template", "processor_class")}


# Processor modules that import a torchvision module only for a function its PIL twin defines
# identically: loaded with the PIL module standing in (PixtralProcessor uses only
# get_resize_output_image_size from image_processing_pixtral, in _get_num_multimodal_tokens;
# Gemma4Processor on transformers 5.12 the kwargs class and the resize rule).
_TORCHVISION_FREE = {
    # 5.12: processing_gemma4 imports Gemma4ImageProcessorKwargs and get_aspect_ratio_preserving_size
    # from image_processing_gemma4; the PIL module defines both identically
    "Gemma4Processor": (
        "transformers.models.gemma4.processing_gemma4",
        {
            "transformers.models.gemma4.image_processing_gemma4": (
                "transformers.models.gemma4.image_processing_pil_gemma4"
            )
        },
    ),
    "PixtralProcessor": (
        "transformers.models.pixtral.processing_pixtral",
        {
            "transformers.models.pixtral.image_processing_pixtral": (
                "transformers.models.pixtral.image_processing_pil_pixtral"
            )
        },
    ),
}


def _processor_class(cls_name: str) -> Any:
    """The processor class by name; a torchvision-gated one listed above is imported without torchvision."""
    try:
        cls = getattr(transformers, cls_name, None)
    except ImportError:  # 5.8 - 5.12 without torchvision: Gemma4Processor's module imports the torchvision class
        cls = None
    if cls_name not in _TORCHVISION_FREE or is_torchvision_available():
        return cls
    module_name, stand_ins = _TORCHVISION_FREE[cls_name]
    module = sys.modules.get(module_name)
    if module is None or not hasattr(module, cls_name):
        saved = {name: sys.modules.get(name) for name in stand_ins}
        sys.modules.update({name: importlib.import_module(pil) for name, pil in stand_ins.items()})
        try:
            spec = importlib.util.find_spec(module_name)
            if spec is None or spec.loader is None:
                return cls
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # auto_docstring looks the class's module up there
            spec.loader.exec_module(module)
        finally:
            for name, old in saved.items():
                if old is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = old
    return getattr(module, cls_name)


def _image_only_processor(
    cls_name: str,
    image_processor: Any,
    tokenizer: Any,
    template: str,
    settings: dict[str, Any],
    video_config: dict[str, Any] | None = None,
) -> Any:
    """The real processor class without its video processor: exact for image/text samples.

    Some ``__init__`` read settings off the video processor (MiniCPM-V 4.6: ``slice_mode``,
    ``downsample_mode``): those get a stand-in holding ``video_config`` (the video processor's
    JSON) for the call, and ``video_processor`` is None again afterwards, so a video sample
    still reports the missing video processor.
    """
    cls = _processor_class(cls_name)
    if cls is None:
        return None

    class ImageOnly(cls):  # type: ignore[misc, valid-type]
        """Skips only the class checks of the absent video processor (it needs torchvision) and
        audio feature extractor (Qwen-Omni: audio is never passed, it is an unsupported_media row)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name in ("video_processor", "feature_extractor") and (
                argument is None or isinstance(argument, _VideoSettingsOnly)
            ):
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    # the video slot exists from transformers 5.13 on for some classes (Idefics3), the audio slot is a
    # required argument of some (Gemma4Processor): fill each only where the class has it
    parameters = inspect.signature(cls.__init__).parameters
    empty_slots: dict[str, Any] = {
        name: None for name in ("video_processor", "feature_extractor") if name in parameters
    }
    try:
        try:
            return ImageOnly(
                image_processor=image_processor, tokenizer=tokenizer, chat_template=template, **empty_slots, **settings
            )
        except AttributeError:
            if "video_processor" not in parameters or not video_config:
                raise
            stand_in = _VideoSettingsOnly(video_config)
            processor = ImageOnly(
                image_processor=image_processor,
                tokenizer=tokenizer,
                chat_template=template,
                **{**empty_slots, "video_processor": stand_in},
                **settings,
            )
            processor.video_processor = None
            return processor
    except (TypeError, ValueError, ImportError, AttributeError) as exc:
        log.warning("cannot build %s without a video processor (%s); verification is off", cls_name, exc)
        return None


class _VideoSettingsOnly:
    """The video processor's JSON settings as attributes, for a processor ``__init__`` that reads them."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.__dict__.update(config)


def _read_json(path: str, filename: str) -> dict[str, Any]:
    resolved = cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
    if resolved is None:
        return {}
    with open(resolved, encoding="utf-8") as fh:
        return json.load(fh)


def _require_template(path: str, template: Any) -> str:
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ProcessorLoadError(f"{path!r} has no chat template; add chat_template.jinja to it")
    return template
