"""Images a request names by URL, loaded: `data:` URLs decoded, `http(s)` URLs fetched within the operator's rules.

Fetching is off unless the server is started with `--allowed-media-domains`. A URL's host must be one of those
names (or a subdomain of one); every address the name resolves to is checked, and one that is private, loopback,
link-local or otherwise not public is refused unless the allow-list names that address (or a network holding it)
itself, so a public name pointed at an internal service reaches nothing. The connection goes to the address that
was checked (the name travels as the Host header and TLS server name), so the name cannot be re-resolved
elsewhere in between. Redirects are followed by hand, each hop checked the same way, up to a few; the body is
read up to a size limit, and the whole fetch within a time limit. Anything refused is a 400 naming the image's
place in the request and why.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
import warnings
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx
from PIL import Image

from server.openai.errors import APIError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""What an image may be encoded as (a GIF's first frame is its image)."""
MAX_REDIRECTS = 3
MAX_PIXELS = 40_000_000
"""Decoded size limit (a small file can hold a huge image: a decompression bomb)."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class MediaPolicy:
    """What the server may load (--allowed-media-domains, --max-image-bytes, --media-fetch-timeout)."""

    allowed_domains: tuple[str, ...] = ()
    """Host names (a subdomain of one is allowed too) and addresses or networks that URLs may reach; empty: no
    fetching at all."""
    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0

    @classmethod
    def of(cls, allowed: str | None, max_bytes: int, timeout_s: float) -> MediaPolicy:
        names = tuple(part.strip().lower().rstrip(".") for part in (allowed or "").split(",") if part.strip())
        return cls(names, max_bytes, timeout_s)

    def _networks(self) -> list[Network]:
        networks = []
        for entry in self.allowed_domains:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                continue
        return networks

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == name or host.endswith("." + name) for name in self.allowed_domains)

    def address_allowed(self, address: str) -> bool:
        """A public address, or one the allow-list names (as itself or inside a network it lists)."""
        ip = ipaddress.ip_address(address)
        if ip.is_global and not ip.is_multicast:
            return True
        return any(ip in network for network in self._networks())


class ImageRefused(APIError):
    def __init__(self, param: str, why: str, code: str = "invalid_image") -> None:
        super().__init__(400, f"The image at '{param}' was refused: {why}", param=param, code=code)


async def load_image(url: str, policy: MediaPolicy, param: str) -> Image.Image:
    """The image `url` names, decoded (RGB, or what the file holds), or ImageRefused saying why not."""
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url, policy, param), param)
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageRefused(param, "an image URL is a data: URL or an http(s) URL", code="invalid_image_url")
    if not policy.allowed_domains:
        raise ImageRefused(
            param, "fetching image URLs is off on this server (start it with --allowed-media-domains to allow "
            "hosts); send the image as a base64 data: URL", code="image_url_not_allowed",
        )  # fmt: skip
    try:
        body = await asyncio.wait_for(_fetch(url, policy, param), policy.timeout_s)
    except TimeoutError:
        raise ImageRefused(
            param, f"fetching it took longer than {policy.timeout_s:g} s", code="image_fetch_failed"
        ) from None
    return decode_image(body, param)


def decode_image(data: bytes, param: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in IMAGE_FORMATS:
                raise ImageRefused(param, f"a {image.format} image; images are {', '.join(IMAGE_FORMATS)}")
            if image.width * image.height > MAX_PIXELS:
                raise ImageRefused(param, f"{image.width}x{image.height} pixels is more than {MAX_PIXELS:,}",
                                   code="image_too_large")  # fmt: skip
            image.seek(0)  # an animation's first frame
            image.load()
    except ImageRefused:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRefused(param, f"the data is not a readable image ({', '.join(IMAGE_FORMATS)}): {exc}") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def _data_url_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise ImageRefused(param, "a data: URL must be data:image/<type>;base64,<data>", code="invalid_image_url")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ImageRefused(param, f"it is larger than {policy.max_bytes:,} bytes", code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(param, "its base64 data does not decode", code="invalid_image_url") from None


async def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            host = parts.hostname or ""
            if parts.scheme.lower() not in ("http", "https") or not policy.host_allowed(host):
                raise ImageRefused(
                    param, f"{url!r} is not on a host this server may fetch from (--allowed-media-domains)",
                    code="image_url_not_allowed",
                )  # fmt: skip
            address = await _checked_address(host, parts.port or (443 if parts.scheme == "https" else 80), policy,
                                             param)  # fmt: skip
            netloc = f"[{address}]" if ":" in address else address
            if parts.port:
                netloc += f":{parts.port}"
            direct = parts._replace(netloc=netloc).geturl()
            try:
                async with client.stream(
                    "GET", direct, headers={"Host": parts.netloc.rpartition("@")[2]},
                    extensions={"sni_hostname": host},
                ) as response:  # fmt: skip
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise ImageRefused(param, f"fetching it answered HTTP {response.status_code}",
                                           code="image_fetch_failed")  # fmt: skip
                    return await _body(response, policy, param)
            except httpx.HTTPError as exc:
                raise ImageRefused(param, f"fetching it failed: {exc}", code="image_fetch_failed") from None
    raise ImageRefused(param, f"more than {MAX_REDIRECTS} redirects", code="image_fetch_failed")


async def _checked_address(host: str, port: int, policy: MediaPolicy, param: str) -> str:
    """The address to connect to: every address `host` resolves to must be allowed (the first is used)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ImageRefused(param, f"its host {host!r} does not resolve: {exc}", code="image_fetch_failed") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    refused = [address for address in addresses if not policy.address_allowed(address)]
    if refused or not addresses:
        raise ImageRefused(
            param, f"its host {host!r} resolves to {', '.join(refused) or 'nothing'}, a private or local address "
            "this server may not fetch from (add the address to --allowed-media-domains to allow it)",
            code="image_url_not_allowed",
        )  # fmt: skip
    return addresses[0]


async def _body(response: httpx.Response, policy: MediaPolicy, param: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
        raise ImageRefused(param, f"it is larger than {policy.max_bytes:,} bytes", code="image_too_large")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > policy.max_bytes:
            raise ImageRefused(param, f"it is larger than {policy.max_bytes:,} bytes", code="image_too_large")
    return bytes(body)
