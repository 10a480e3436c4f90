"""Reason codes for rows of the errors table: one stable code per way a sample can fail."""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    """Why an input row became an error row instead of a sample."""

    MALFORMED_JSON = "malformed_json"
    NOT_UTF8 = "not_utf8"
    BAD_RECORD = "bad_record"
    EMPTY_CONVERSATION = "empty_conversation"
    BAD_ROLE = "bad_role"
    MEDIA_TAG_MISMATCH = "media_tag_mismatch"
    MISSING_MEDIA = "missing_media"
    MEDIA_OUTSIDE_ROOT = "media_outside_root"  # resolves (after .. and symlinks) outside every --media-root
    MISSING_LMDB_KEY = "missing_lmdb_key"
    CORRUPT_IMAGE = "corrupt_image"
    IMAGE_TOO_LARGE = "image_too_large"  # more pixels than --max-image-pixels (e.g. a decompression bomb)
    BAD_VIDEO = "bad_video"
    PROCESSOR_REJECTED = "processor_rejected"
    UNSUPPORTED_MEDIA = "unsupported_media"  # the processor takes no media of this kind (e.g. Pixtral video)
    TEMPLATE_ERROR = "template_error"
    TOO_LONG = "too_long"
