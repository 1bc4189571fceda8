"""Images in chat requests: an `image_url` part's bytes, from a data URL or from a file under
the directory the operator allows (`--allowed-local-media-path`, vLLM's flag), never fetched from
the network; each checked against the limits (`MediaLimits`) with a 400 in OpenAI's envelope."""

from __future__ import annotations

import argparse
import base64
import binascii
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from base.errors import UserError
from server.openai.errors import APIError, invalid_request

IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
"""Content part types that carry an image (chat's, the Responses API's, vLLM's)."""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What one request may send of images."""

    max_image_bytes: int = 20 * 2**20
    """The largest image file (decoded from its data URL, or read)."""
    max_images: int = 8
    """Images per request."""
    max_pixels: int = 8192 * 8192
    """The largest width x height before the processor's resize (a decompression bomb stops
    here, before any pixel is decoded)."""
    allowed_local_media_path: Path | None = None
    """`file://` URLs (and plain paths) are read only under this directory; None: refused."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-image-bytes", self.max_image_bytes),
            ("--max-images-per-request", self.max_images),
            ("max_pixels", self.max_pixels),
        ):
            if value < 1:
                raise UserError(f"{flag} must be >= 1, got {value}")


NO_LOCAL_MEDIA = MediaLimits()
"""The default limits: data URLs alone."""


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    """The image flags of `nanoflex serve` and `nanoflex run-batch`."""
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="chat image parts may name files under this directory (file:// URLs); none are "
        "read without it, and images are never fetched from the network (default: none)",
    )
    parser.add_argument(
        "--max-images-per-request",
        type=int,
        default=NO_LOCAL_MEDIA.max_images,
        metavar="N",
        help="most image parts one chat request may carry (default: %(default)s)",
    )
    parser.add_argument(
        "--max-image-bytes",
        type=int,
        default=NO_LOCAL_MEDIA.max_image_bytes,
        metavar="BYTES",
        help="the largest image file one image part may carry (default: %(default)s)",
    )


def media_limits_from(args: argparse.Namespace) -> MediaLimits:
    """The image limits the flags of `serve` or `run-batch` set; a local media path must be a
    directory."""
    given = getattr(args, "allowed_local_media_path", None)
    limits = MediaLimits(  # a namespace without the flags (not serve's): the defaults
        max_image_bytes=getattr(args, "max_image_bytes", NO_LOCAL_MEDIA.max_image_bytes),
        max_images=getattr(args, "max_images_per_request", NO_LOCAL_MEDIA.max_images),
    )
    if given is None:
        return limits
    path = Path(given).resolve()
    if not path.is_dir():
        raise UserError(f"--allowed-local-media-path {given} is not a directory")
    return replace(limits, allowed_local_media_path=path)


@dataclass(frozen=True, slots=True)
class LoadedImage:
    """An image part's file and its size."""

    data: bytes
    width: int
    height: int


def image_url_of(part: dict[str, Any], param: str) -> str:
    """The URL of an image part: {"image_url": {"url": ...}} or {"image_url": "..."} (chat),
    {"image_url": "..."} (Responses' input_image), {"image": "..."} (vLLM's)."""
    value = part.get("image_url", part.get("image"))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise invalid_request(f"an {part.get('type')} part needs its image's URL", param=param)
    return value


def load_image(url: str, limits: MediaLimits, param: str) -> LoadedImage:
    """The image at `url` (a data URL, or a local file the limits allow), checked: an image
    file PIL can read, within the byte and pixel limits. Raises a 400 `APIError` otherwise."""
    if url.startswith("data:"):
        data = _data_url_bytes(url, limits, param)
    else:
        data = _local_file_bytes(url, limits, param)
    return _checked(data, limits, param)


def _data_url_bytes(url: str, limits: MediaLimits, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise invalid_request(
            "an image data URL must be data:image/<type>;base64,<data>", param=param
        )
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
        raise _too_large(len(payload) * 3 // 4, limits, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid_request(f"the image data URL is not valid base64: {e}", param=param) from e


def _local_file_bytes(url: str, limits: MediaLimits, param: str) -> bytes:
    parsed = urlparse(url)
    if parsed.scheme not in ("", "file"):
        raise invalid_request(
            f"image URLs with scheme {parsed.scheme!r} are not fetched: send the image as a "
            "data URL (data:image/png;base64,...)",
            param=param,
            code="image_url_not_allowed",
        )
    root = limits.allowed_local_media_path
    if root is None:
        raise invalid_request(
            "local image files are not allowed: the server was started without "
            "--allowed-local-media-path; send the image as a data URL",
            param=param,
            code="image_url_not_allowed",
        )
    path = Path(unquote(parsed.path if parsed.scheme else url)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise invalid_request(
            f"{path} is outside the allowed local media path {root}",
            param=param,
            code="image_url_not_allowed",
        )
    try:
        size = path.stat().st_size
        if size > limits.max_image_bytes:
            raise _too_large(size, limits, param)
        return path.read_bytes()
    except OSError as e:
        raise invalid_request(f"cannot read the image {path}: {e.strerror}", param=param) from e


def _checked(data: bytes, limits: MediaLimits, param: str) -> LoadedImage:
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits, param)
    try:
        with Image.open(io.BytesIO(data)) as picture:  # reads the header: no pixels yet
            width, height = picture.size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise invalid_request(f"the image cannot be read: {e}", param=param) from e
    if width * height > limits.max_pixels:
        raise invalid_request(
            f"the image is {width}x{height} pixels; the limit is {limits.max_pixels} pixels",
            param=param,
            code="image_too_large",
        )
    return LoadedImage(data, width, height)


def _too_large(size: int, limits: MediaLimits, param: str) -> APIError:
    return invalid_request(
        f"the image is {size} bytes; the limit is {limits.max_image_bytes} bytes per image",
        param=param,
        code="image_too_large",
    )
