"""Video verification decodes with PyAV on every torchvision: `processor_path.fetch_videos_with_pyav`.

It stands in for ``BaseVideoProcessor.fetch_videos`` (transformers picks torchcodec, else the
``torchvision.io.read_video`` that torchvision 0.26 removed). Oracles: the container fields
``prep`` counts with (`prep.sources.media.video_meta`) and the frames ``train`` decodes
(`train.media.decode_video_frames`), both PyAV read independently; the frame indices come from
the processor's own ``sample_indices_fn`` contract (called with the metadata).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from packvlm.sample_error import SampleError
from prep.example.media import write_corrupt_video, write_video
from prep.sources.media import video_meta
from prep.tokenize.processor_path import fetch_videos_with_pyav
from schemas.media_ref import MediaRef
from schemas.reasons import Reason
from train.media import MediaOrigin, decode_video_frames

INDICES = [0, 3, 7, 10]


def _pick(metadata: Any, **_: Any) -> list[int]:
    assert metadata.total_num_frames == 12  # the processor samples from the container's count
    return INDICES


def test_frames_and_metadata_equal_prep_and_train_decoding(tmp_path: Path) -> None:
    path = write_video(tmp_path / "clip.mp4", num_frames=12, fps=6.0, width=64, height=48, seed=1)
    frames, metadata = fetch_videos_with_pyav(str(path), sample_indices_fn=_pick)
    meta = video_meta(MediaRef(path=str(path)))
    assert (metadata.total_num_frames, metadata.fps) == (meta.num_frames, meta.fps)
    assert (metadata.width, metadata.height) == (meta.width, meta.height) == (64, 48)
    assert list(metadata.frames_indices) == INDICES
    decoded = decode_video_frames(
        path.read_bytes(), INDICES, MediaOrigin(pack_key="p", sample_id="s", member="clip.mp4")
    )
    assert frames.shape == (len(INDICES), 48, 64, 3)
    np.testing.assert_array_equal(frames, decoded.frames)
    # a list of videos gives (frames list, metadata list), as transformers' own fetch_videos
    many, metas = fetch_videos_with_pyav([str(path), str(path)], sample_indices_fn=_pick)
    assert len(many) == len(metas) == 2 and np.array_equal(many[1], frames)


def test_undecodable_video_is_a_bad_video_row(tmp_path: Path) -> None:
    path = write_corrupt_video(tmp_path / "corrupt.mp4")
    with pytest.raises(SampleError) as err:
        fetch_videos_with_pyav(str(path), sample_indices_fn=_pick)
    assert err.value.reason == Reason.BAD_VIDEO and "corrupt.mp4" in str(err.value)
