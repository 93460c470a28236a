"""Images through the HTTP API: the OpenAI SDK sends a base64 image and an allowed URL (served by a local test
server) to a real `ferry serve` of a tiny LLaVA, and gets the model's own answer; what must be refused (a host not
allowed, a redirect to one, a body that is no image, one over the size limit, too many images, a name resolving to a
loopback address, fetching while it is off) gets the right 400."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import openai
import pytest
from PIL import Image

from server.media import ImageRefused, MediaPolicy, load_image
from server.openai.images import no_images
from server.openai.schemas import ChatCompletionRequest
from tests.server_harness import metric, metric_samples, server_process
from tests.vision_models import Prompts, build_llava_dir, data_url, random_image

MAX_IMAGE_BYTES = 20_000
PICTURE = random_image(7)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class _Images(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, dict[str, str], bytes]]] = {
        "/picture.png": (200, {"Content-Type": "image/png"}, _png(PICTURE)),
        "/huge.png": (200, {"Content-Type": "image/png"}, _png(random_image(8, 200, 200))),
        "/page.html": (200, {"Content-Type": "text/html"}, b"<html>not a picture</html>"),
        "/inside": (302, {"Location": "/picture.png"}, b""),
        "/outside": (302, {"Location": "http://images.invalid/picture.png"}, b""),
    }

    def do_GET(self) -> None:
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava_dir(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def server(llava: Path) -> Iterator[str]:
    with server_process(
        llava, "--allowed-media-domains", "127.0.0.1", "--max-image-bytes", str(MAX_IMAGE_BYTES),
        "--limit-mm-per-prompt", "image=2", "--served-model-name", "llava",
    ) as process:  # fmt: skip
        yield process.base_url


def _ask(client: openai.OpenAI, *urls: str, text: str = "what is in the picture?") -> openai.types.chat.ChatCompletion:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "low"}} for url in urls]
    return client.chat.completions.create(
        model="llava", messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        max_tokens=6, temperature=0,
    )  # fmt: skip


def test_the_sdk_gets_the_models_own_answer_for_a_base64_image_and_an_allowed_url(
    server: str, llava: Path, image_host: str
) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    prompts = Prompts(llava)
    content = [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]
    ids, images = prompts.engine_inputs(content, [PICTURE])
    tokens, _ = prompts.generate(content, [PICTURE], 6)
    expected = prompts.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    inline = _ask(client, data_url(PICTURE))
    assert inline.choices[0].message.content == expected
    assert inline.usage.prompt_tokens == len(ids)  # the image's tokens count
    fetched = _ask(client, f"{image_host}/inside")  # a redirect within the allowed host
    assert fetched.choices[0].message.content == expected
    assert fetched.usage.prompt_tokens_details.cached_tokens >= images[0].end  # same image, same pages
    # Text before the image: no cached page holds it, so its encoding comes from the encoder cache.
    response = client.responses.create(
        model="llava", max_output_tokens=6, temperature=0, store=False,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "look:"},
            {"type": "input_image", "image_url": f"{image_host}/picture.png"},
        ]}],
    )  # fmt: skip
    content = [{"type": "text", "text": "look:"}, {"type": "image"}]
    tokens, _ = prompts.generate(content, [PICTURE], 6)
    assert response.output_text == prompts.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    import httpx

    samples = metric_samples(httpx.Client(base_url=server))
    assert metric(samples, "ferry:images_processed_total") == 3
    assert metric(samples, "ferry:encoder_cache_hits_total") == 1  # the prefix cache served the second


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("http://images.invalid/picture.png", "image_url_not_allowed"),
        ("/outside", "image_url_not_allowed"),
        ("/page.html", "invalid_image"),
        ("/huge.png", "image_too_large"),
        ("/missing.png", "image_fetch_failed"),
        ("ftp://127.0.0.1/picture.png", "invalid_image_url"),
    ],
)
def test_what_may_not_be_fetched_or_read_is_a_400_saying_why(
    server: str, image_host: str, path: str, code: str
) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    url = image_host + path if path.startswith("/") else path
    with pytest.raises(openai.BadRequestError) as error:
        _ask(client, url)
    assert error.value.code == code
    assert error.value.param == "messages[0].content[0].image_url.url"


def test_too_many_images_and_broken_data_urls_are_400s(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        _ask(client, *[data_url(PICTURE)] * 3)
    assert error.value.code == "too_many_images"
    for broken in ("data:image/png;base64,!!!", "data:text/plain;base64,aGk=", data_url(random_image(9, 200, 200))):
        with pytest.raises(openai.BadRequestError) as error:
            _ask(client, broken)
        assert error.value.code in ("invalid_image_url", "image_too_large")


def test_a_name_resolving_to_a_loopback_address_is_refused_unless_that_address_is_allowed() -> None:
    by_name = MediaPolicy.of("localhost", MAX_IMAGE_BYTES, 5.0)
    with pytest.raises(ImageRefused, match="private or local address"):
        asyncio.run(load_image("http://localhost:9/picture.png", by_name, "url"))
    assert MediaPolicy.of("localhost,127.0.0.0/8", 1, 1.0).address_allowed("127.0.0.1")
    assert not MediaPolicy.of("localhost", 1, 1.0).address_allowed("10.1.2.3")
    with pytest.raises(ImageRefused, match="fetching image URLs is off"):
        asyncio.run(load_image("http://example.com/picture.png", MediaPolicy(), "url"))


def test_a_text_model_refuses_images_by_name() -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}}]}],
    })  # fmt: skip
    refs: list = []
    messages = body.template_messages(refs)
    assert messages[0]["content"] == [{"type": "image"}] and len(refs) == 1
    with pytest.raises(Exception, match="takes no images") as error:
        no_images(refs)
    assert error.value.status_code == 400  # type: ignore[attr-defined]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_image_format_decodes_to_its_picture(fmt: str) -> None:
    """PNG, JPEG, WebP and a GIF's first frame, as a data: URL; anything else is refused by name."""
    first, second = random_image(11, 24, 16), random_image(12, 24, 16)
    buffer = io.BytesIO()
    if fmt == "GIF":
        first.save(buffer, format="GIF", save_all=True, append_images=[second])
    else:
        first.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"
    image = asyncio.run(load_image(url, MediaPolicy(), "url"))
    assert image.mode == "RGB" and image.size == (24, 16)
    if fmt in ("PNG", "WEBP"):  # lossless: the very pixels
        assert image.tobytes() == first.tobytes()
    if fmt == "GIF":  # its first frame, not its second (palette colours: compared as the GIF holds them)
        with Image.open(io.BytesIO(buffer.getvalue())) as gif:
            gif.seek(0)
            assert image.tobytes() == gif.convert("RGB").tobytes()
    bmp = io.BytesIO()
    first.save(bmp, format="BMP")
    with pytest.raises(ImageRefused, match="BMP"):
        asyncio.run(
            load_image(f"data:image/bmp;base64,{base64.b64encode(bmp.getvalue()).decode()}", MediaPolicy(), "u")
        )
