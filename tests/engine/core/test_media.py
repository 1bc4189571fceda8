"""The daemon's image arithmetic (engine/core/media.py) against the processor's: the patch grid
of every size, and the prefix cache's key of an image's tokens."""

from __future__ import annotations

from engine.core.media import SeqMedia, VisionSpec, cache_token_ids, expand_image_tokens

SPEC = VisionSpec(
    image_token_id=9,
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 64,
)


def test_grid_is_the_processors() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for width, height in [
        (1, 1),
        (27, 500),
        (60, 90),
        (224, 224),
        (1000, 33),
        (2000, 13),
        (3000, 2000),
    ]:
        h, w = smart_resize(height, width, 28, SPEC.min_pixels, SPEC.max_pixels)
        assert SPEC.grid(width, height) == (1, h // 14, w // 14), (width, height)


def test_image_tokens_widen_and_key_the_cache_by_image() -> None:
    ids = [1, 9, 2, 9, 3]
    media = expand_image_tokens(ids, SPEC, [(b"a", 56, 56), (b"b", 112, 56)])
    assert isinstance(media, SeqMedia)
    assert ids == [1, 9, 9, 9, 9, 2, *[9] * 8, 3]  # 2x2 and 4x2 merged tokens
    assert [(i.start, i.num_tokens) for i in media.images] == [(1, 4), (6, 8)]
    # the first image at (1, 1 + row, 1 + column); the text after it from 1 + max(2, 2)
    assert media.positions[1:6] == ((1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2), (3, 3, 3))
    assert media.position(len(ids)) == (len(ids) + media.delta,) * 3
    keys = cache_token_ids(ids, media)
    assert keys[0] == 1 and keys[5] == 2 and len(set(keys[1:5])) == 1 and keys[1] < -1
    other = expand_image_tokens([1, 9, 2, 9, 3], SPEC, [(b"c", 56, 56), (b"b", 112, 56)])
    assert cache_token_ids(ids, other)[1] != keys[1]  # another image, another key
    assert cache_token_ids(ids, other)[6:14] == keys[6:14]  # the same one, the same key
