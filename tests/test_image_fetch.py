"""Image URLs fetched (``api/images.py``), against httpx's ``MockTransport`` (no network): a
public host's image comes back as bytes; a redirect, an error status, an image over the byte
limit or a fetch past its time limit is a 400-worthy ``ImageError`` naming the part; a private
address is refused before any request is sent.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from mlx_trio.api.images import ImageLoader, ImageRef, ImageSettings
from mlx_trio.engine.errors import ImageError

PUBLIC = "http://93.184.215.14/cat.png"  # an address literal: no name to resolve
WHERE = "messages.[0].content.[1]"


def loader(handler, **settings: object) -> tuple[ImageLoader, list[httpx.Request]]:
    sent: list[httpx.Request] = []

    async def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return await handler(request)

    limits = ImageSettings(allow_urls=True, **settings)  # type: ignore[arg-type]
    return ImageLoader(limits, transport=httpx.MockTransport(record)), sent


async def png_bytes(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"\x89PNG fake image bytes")


async def test_a_public_url_is_fetched_as_its_bytes():
    images, sent = loader(png_bytes)
    image = await images.load_one(ImageRef(WHERE, PUBLIC))
    assert image.data == b"\x89PNG fake image bytes" and image.where == WHERE
    assert [str(r.url) for r in sent] == [PUBLIC]


async def redirect(request: httpx.Request) -> httpx.Response:
    return httpx.Response(302, headers={"Location": "http://127.0.0.1/secret"})


async def big(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"x" * 5000)


async def slow(request: httpx.Request) -> httpx.Response:
    await trio.sleep(5)
    return httpx.Response(200, content=b"late")


@pytest.mark.parametrize(
    ("handler", "settings", "says"),
    [
        (redirect, {}, "got HTTP 302"),  # never followed: it could lead anywhere
        (big, {"max_bytes": 4096}, "over this server's limit of 4096 bytes"),
        (slow, {"fetch_timeout_s": 0.05}, "took over 0.05 s"),
    ],
)
async def test_a_fetch_that_goes_wrong_names_the_part(handler, settings, says, autojump_clock):
    images, _ = loader(handler, **settings)
    with pytest.raises(ImageError, match=r"^messages\.\[0\]\.content\.\[1\]: ") as caught:
        await images.load_one(ImageRef(WHERE, PUBLIC))
    assert says in caught.value.message and caught.value.param == WHERE


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/cat.png",
        "http://10.1.2.3/cat.png",
        "http://192.168.0.7/cat.png",
        "http://169.254.169.254/latest/meta-data",  # a cloud's metadata service
        "http://[::1]/cat.png",
        "http://[::ffff:127.0.0.1]/cat.png",
        "http://localhost/cat.png",
        "http://0.0.0.0/cat.png",
    ],
)
async def test_a_private_or_local_address_is_refused_before_any_request(url):
    images, sent = loader(png_bytes)
    with pytest.raises(ImageError, match="private or local address"):
        await images.load_one(ImageRef(WHERE, url))
    assert sent == []


async def test_without_the_flag_no_url_is_fetched():
    sent: list[httpx.Request] = []

    async def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, content=b"image")

    images = ImageLoader(ImageSettings(), transport=httpx.MockTransport(record))
    with pytest.raises(ImageError, match="without --allow-image-urls"):
        await images.load_one(ImageRef(WHERE, PUBLIC))
    assert sent == []


async def test_a_named_host_is_fetched_from_the_address_that_was_checked(monkeypatch):
    """No second lookup that could answer a private address (DNS rebinding): the request goes
    to the public address checked, naming the host in its Host header and for TLS."""
    answers = iter(["93.184.215.14", "127.0.0.1"])  # the first lookup, then a rebinding one

    async def getaddrinfo(host, port, *args, **kwargs):
        return [(2, 1, 6, "", (next(answers), 0))]

    monkeypatch.setattr(trio.socket, "getaddrinfo", getaddrinfo)
    images, sent = loader(png_bytes)
    await images.load_one(ImageRef(WHERE, "https://images.example:8443/cat.png?size=2"))
    (request,) = sent
    assert str(request.url) == "https://93.184.215.14:8443/cat.png?size=2"
    assert request.headers["Host"] == "images.example:8443"
    assert request.extensions["sni_hostname"] == "images.example"
