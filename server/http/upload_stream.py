"""`receive_upload`: a multipart POST /v1/files body streamed straight into the data directory.

The body is parsed as it arrives (python-multipart's streaming parser): the bytes of the
part named 'file' go, in writes of about `FLUSH_BYTES`, to a temporary file beside their
final path in the data directory (`FileStorage.open_upload`), so each byte is written once,
nothing lands in the system temp directory, and a full disk there is the data directory's
own 507. Other fields ('purpose') are small and kept in memory. The caller commits the
file, or discards it: an upload refused midway (too large, past `--max-stored-bytes`, a
full disk, a malformed body, a client gone) leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

from server.batch.files import FileStorage, PendingFile
from server.openai.errors import APIError, invalid_request

FLUSH_BYTES = 1 << 20
"""File bytes gathered in memory before one write to disk (off the event loop)."""
MAX_FIELD_BYTES = 1024
"""Largest value of a field other than the file ('purpose' is a short word)."""
MAX_PARTS = 8
"""Most parts in one upload body."""
FILE_FIELD = "file"


def _send_the_file() -> APIError:
    return invalid_request(
        "Send the file as the multipart field 'file' (multipart/form-data).", param=FILE_FIELD
    )


@dataclass
class _Part:
    """The part being parsed: its headers, then where its data goes."""

    header_field: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


@dataclass
class ReceivedUpload:
    """What came with an upload: the file (written, not yet committed), its name as sent,
    and the other fields."""

    pending: PendingFile | None = None
    filename: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


class _Receiver:
    """The parser's callbacks: a part's headers decide whether its data is the file (to
    disk) or a field (to memory)."""

    def __init__(self, storage: FileStorage, file_id: str) -> None:
        self.storage = storage
        self.file_id = file_id
        self.upload = ReceivedUpload()
        self.buffer = bytearray()
        """File bytes not yet written."""
        self.part = _Part()
        self.num_parts = 0
        self.ended = False

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self.part.header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self.part.header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._end,
            "on_end": lambda: setattr(self, "ended", True),
        }

    def _begin(self) -> None:
        self.num_parts += 1
        if self.num_parts > MAX_PARTS:
            raise invalid_request(f"An upload has at most {MAX_PARTS} multipart fields.")
        self.part = _Part()

    def _header_end(self) -> None:
        part = self.part
        if bytes(part.header_field).lower() == b"content-disposition":
            _, options = parse_options_header(bytes(part.header_value))
            part.name = options.get(b"name", b"").decode("utf-8", "replace")
            filename = options.get(b"filename")
            part.filename = None if filename is None else filename.decode("utf-8", "replace")
        part.header_field.clear()
        part.header_value.clear()

    def _headers_finished(self) -> None:
        part = self.part
        if part.name != FILE_FIELD and part.filename is None:
            return
        if part.name != FILE_FIELD or self.upload.pending is not None:
            raise _send_the_file()  # a file under another name, or a second file
        self.upload.filename = part.filename
        self.upload.pending = self.storage.open_upload(self.file_id)

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self.part
        if part.name == FILE_FIELD and self.upload.pending is not None:
            self.buffer.extend(data[start:end])
            return
        part.value.extend(data[start:end])
        if len(part.value) > MAX_FIELD_BYTES:
            raise invalid_request(
                f"The field {part.name!r} is longer than {MAX_FIELD_BYTES} bytes.", param=part.name
            )

    def _end(self) -> None:
        part = self.part
        if part.name and part.name != FILE_FIELD:
            self.upload.fields[part.name] = part.value.decode("utf-8", "replace")


async def receive_upload(
    stream: AsyncIterator[bytes],
    content_type: str,
    storage: FileStorage,
    file_id: str,
    room_bytes: int | None,
) -> ReceivedUpload:
    """Parse a multipart body from `stream`, writing its 'file' part to `file_id`'s pending
    file. Raises (the partial file removed) `NoRoom` once the file passes `room_bytes`
    (None: no bound), a 400 `APIError` for a malformed body, `StorageError` on a storage
    failure, and whatever `stream` raises (413, 408, a disconnect). The caller commits or
    discards `ReceivedUpload.pending`."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _send_the_file()
    receiver = _Receiver(storage, file_id)
    try:
        parser = MultipartParser(boundary, receiver.callbacks())  # type: ignore[arg-type]
        async for chunk in stream:
            try:
                parser.write(chunk)
            except MultipartParseError as e:
                raise invalid_request(f"The multipart body is malformed: {e}") from None
            await _flush(receiver, room_bytes, at_least=FLUSH_BYTES)
        if not receiver.ended:
            raise invalid_request("The multipart body ends before its closing boundary.")
        await _flush(receiver, room_bytes, at_least=1)
        if receiver.upload.pending is None:
            raise _send_the_file()
        return receiver.upload
    except BaseException:
        if receiver.upload.pending is not None:
            receiver.upload.pending.discard()
        raise


class NoRoom(Exception):
    """The file passed the room left under `--max-stored-bytes` (`num_bytes` so far)."""

    def __init__(self, num_bytes: int) -> None:
        super().__init__(num_bytes)
        self.num_bytes = num_bytes


async def _flush(receiver: _Receiver, room_bytes: int | None, *, at_least: int) -> None:
    """Write the gathered file bytes once there are `at_least` of them (off the event loop)."""
    pending, buffer = receiver.upload.pending, receiver.buffer
    if pending is None or len(buffer) < at_least:
        return
    if room_bytes is not None and pending.num_bytes + len(buffer) > room_bytes:
        raise NoRoom(pending.num_bytes + len(buffer))
    data = bytes(buffer)
    buffer.clear()
    await asyncio.to_thread(pending.write, data)
