"""Image parts at the HTTP edge: ``data:`` URLs and base64 blocks decoded to bytes, ``http(s)``
URLs fetched where the server allows it (design/031-images.md).

What leaves here is ``ImageInput``: bytes under ``max_image_bytes`` and the part they came
from; decoding and resizing happen later, off the event loop, where the request is prepared.
A URL is fetched only with ``--allow-image-urls``, with httpx, under the byte limit and a
time limit, following no redirect, and never from a private, loopback, link-local or
otherwise non-public address (its host's every address is checked before the fetch, which then
goes to the address checked).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import httpx
import trio
from pydantic import BaseModel, ConfigDict

from ..engine.errors import ImageError
from ..engine.vocabulary.images import ImageInput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ImageSettings:
    """``max_bytes``: an image's largest size, sent or fetched; ``max_pixels``: its largest
    width x height, read from its header before decoding; ``allow_urls``: fetch ``http(s)``
    image URLs (off: such a part is refused); ``fetch_timeout_s``: a fetch's whole time."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    allow_urls: bool = False
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part as sent: where it is in the request, in its API's words
    (``messages[0].content[1]``), and its URL (a ``data:`` URL or ``http(s)``)."""

    where: str
    url: str


def base64_url(media_type: str, data: str) -> str:
    """A base64 block's data as a ``data:`` URL (the Messages API sends the two apart)."""
    return f"data:{media_type};base64,{data}"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageSource(_Body):
    type: Literal["base64", "url", "file"]
    media_type: str = ""
    data: str = ""
    url: str = ""


class ImageBlock(_Body):
    """The Messages API's ``image`` block."""

    type: Literal["image"]
    source: ImageSource

    def ref(self, where: str) -> ImageRef:
        """The block as an image part at ``where`` (``messages.[0].content.[1]``)."""
        match self.source.type:
            case "base64":
                return ImageRef(where, base64_url(self.source.media_type, self.source.data))
            case "url":
                return ImageRef(where, self.source.url)
        raise ImageError(where, "image sources of type file are not served; send base64 data")


class ImageLoader:
    """Turns image parts into bytes. ``transport``: httpx's transport for fetches (tests give
    a ``MockTransport``; None: the network)."""

    def __init__(
        self, settings: ImageSettings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.settings = settings
        self._transport = transport

    async def load(self, refs: Sequence[ImageRef]) -> dict[str, ImageInput]:
        """Each part's bytes by its ``where``; raises ``ImageError`` naming the first part
        that cannot be had. If cancelled, nothing is kept."""
        return {ref.where: await self.load_one(ref) for ref in refs}

    async def load_one(self, ref: ImageRef) -> ImageInput:
        """One part's bytes; raises ``ImageError``. If cancelled, a fetch is abandoned."""
        scheme = ref.url.split(":", 1)[0].lower()
        if scheme == "data":
            data = self._from_data_url(ref)
        elif scheme in ("http", "https"):
            data = await self._fetch(ref)
        else:
            raise ImageError(ref.where, "an image URL must be a data: URL or http(s)")
        return ImageInput(data, ref.where, self.settings.max_pixels)

    def _from_data_url(self, ref: ImageRef) -> bytes:
        header, comma, payload = ref.url.partition(",")
        kind = header[len("data:") :]
        mime = kind.split(";", 1)[0].strip().lower()
        if not comma or not kind.endswith(";base64"):
            raise ImageError(ref.where, "a data URL must be base64: data:image/png;base64,...")
        if not mime.startswith("image/"):
            raise ImageError(ref.where, f"the data URL's type is {mime or 'missing'}, not image/*")
        if len(payload) > (self.settings.max_bytes + 2) // 3 * 4 + 4:
            raise self._too_large(ref, None)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(ref.where, "the data URL's base64 is malformed") from None
        if len(data) > self.settings.max_bytes:
            raise self._too_large(ref, len(data))
        return data

    def _too_large(self, ref: ImageRef, size: int | None) -> ImageError:
        limit = self.settings.max_bytes
        got = f"{size} bytes" if size is not None else "more"
        return ImageError(
            ref.where,
            f"the image is {got}, over this server's limit of {limit} bytes (--max-image-bytes)",
        )

    async def _fetch(self, ref: ImageRef) -> bytes:
        if not self.settings.allow_urls:
            raise ImageError(
                ref.where,
                "this server fetches no image URLs (started without --allow-image-urls); "
                "send the image as a data: URL",
            )
        parts = urlsplit(ref.url)
        host = parts.hostname
        if not host:
            raise ImageError(ref.where, "the image URL has no host")
        address = await self._public_address(ref, host)
        # The fetch goes to the address just checked, not to a second lookup of the name,
        # which could answer otherwise (DNS rebinding); TLS still checks the name.
        netloc = f"[{address}]" if ":" in address else address
        if parts.port is not None:
            netloc += f":{parts.port}"
        pinned = parts._replace(netloc=netloc).geturl()
        headers = {"Host": parts.netloc.rpartition("@")[2]}
        limit = self.settings.max_bytes
        try:
            with trio.fail_after(self.settings.fetch_timeout_s):
                async with (
                    httpx.AsyncClient(
                        transport=self._transport, follow_redirects=False, trust_env=False
                    ) as client,
                    client.stream(
                        "GET", pinned, headers=headers, extensions={"sni_hostname": host}
                    ) as response,
                ):
                    if response.status_code != 200:
                        raise ImageError(
                            ref.where, f"fetching the image got HTTP {response.status_code}"
                        )
                    data = bytearray()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > limit:
                            raise self._too_large(ref, None)
                    return bytes(data)
        except trio.TooSlowError:
            raise ImageError(
                ref.where, f"fetching the image took over {self.settings.fetch_timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            problem = f"the image could not be fetched ({type(exc).__name__})"
            raise ImageError(ref.where, problem) from None

    async def _public_address(self, ref: ImageRef, host: str) -> str:
        """The address to fetch ``host`` from: its first, once every one of its addresses (a
        literal one, or resolved) is checked to be public; else refused."""
        try:
            infos = await trio.socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            raise ImageError(ref.where, "the image URL's host does not resolve") from None
        addresses = [ipaddress.ip_address(address[0]) for *_, address in infos]
        for ip in addresses:
            if not ip.is_global or ip.is_multicast:
                raise ImageError(
                    ref.where, "the image URL's host is a private or local address; refused"
                )
        if not addresses:
            raise ImageError(ref.where, "the image URL's host does not resolve")
        return str(addresses[0])
