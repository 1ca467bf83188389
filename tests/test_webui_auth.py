"""The web UI behind API keys, tried as an attacker would: raw HTTP against every kind of route (the page's
"private" events through ``/gradio_api/queue/join`` with their ``fn_index``, uploads, files, the live audio,
the named API) and a real gradio_client, with and without the key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the web UI needs the 'ui' extra")
import httpx
from test_webui import TRANSCRIPT, make_studio, serving

KEY = "correct-horse-battery"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    studio = make_studio(tts, tmp_path_factory.mktemp("keyed"), api_keys=(KEY, "second-key"))
    with serving(studio) as url:
        yield studio, url


def _events(config: dict) -> dict[str, tuple[int, list[int]]]:
    """elem_id of the clicked/uploaded component -> (fn_index, input component ids) of its queued events."""
    elem = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    found = {}
    for dep in config["dependencies"]:
        for target, trigger in dep["targets"]:
            if elem.get(target) and dep.get("queue", True) is not False and trigger in ("click", "upload"):
                found.setdefault(elem[target], (dep["id"], dep["inputs"]))
    return found


def call_event(client: httpx.Client, fn_index: int, data: list, session: str = "attacker1") -> httpx.Response | dict:
    """One event as the page sends it: join the queue, then read its server-sent events to the result."""
    joined = client.post("gradio_api/queue/join", json={"data": data, "fn_index": fn_index, "session_hash": session,
                                                        "event_data": None, "trigger_id": None})
    if joined.status_code != 200:
        return joined
    with client.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                message = json.loads(line[5:])
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError("the event never completed")


def test_nothing_answers_without_a_key(keyed: tuple, tmp_path: Path) -> None:
    studio, url = keyed
    with httpx.Client(base_url=url, timeout=30) as anon:
        page = anon.get("", headers={"accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"] == "./studio/login"
        login = anon.get("studio/login")
        assert login.status_code == 200 and 'name="key"' in login.text and "gradio" not in login.text.lower()
        for method, path in [("GET", "config"), ("GET", "gradio_api/info"), ("GET", "gradio_api/heartbeat/x"),
                             ("POST", "gradio_api/queue/join"), ("GET", "gradio_api/queue/data?session_hash=x"),
                             ("POST", "gradio_api/upload"), ("POST", "gradio_api/cancel"),
                             ("GET", f"gradio_api/file={studio._files}/x.wav"), ("GET", "studio/live/take-0001"),
                             ("POST", "gradio_api/call/voices"), ("POST", "gradio_api/run/voices"),
                             ("POST", "gradio_api/stream/x"), ("GET", "gradio_api/mcp/sse")]:
            answer = anon.request(method, path, json={})
            assert answer.status_code == 401, (method, path, answer.status_code)
            assert answer.json()["detail"].startswith("missing or wrong API key")
        assert anon.get("gradio_api/startup-events").json() is False  # open (launch calls it), ran already
        wrong = anon.post("studio/login", data={"key": "guess"})
        assert wrong.status_code == 401 and "Wrong API key" in wrong.text and "set-cookie" not in wrong.headers
        assert anon.get("config", headers={"Authorization": "Bearer guess"}).status_code == 401
        # signing in with the key gives a cookie that opens the app
        signed = anon.post("studio/login", data={"key": KEY})
        assert signed.status_code == 303 and "HttpOnly" in signed.headers["set-cookie"]
        assert anon.get("config").status_code == 200


def test_a_keyless_client_cannot_touch_voices_and_a_keyed_one_can(keyed: tuple, short_prompt_wav: Path) -> None:
    studio, url = keyed
    with httpx.Client(base_url=url, timeout=60, headers=BEARER) as owner:
        events = _events(owner.get("config").json())
        uploaded = owner.post("gradio_api/upload", files={"files": short_prompt_wav.open("rb")}).json()[0]
        audio = {"path": uploaded, "meta": {"_type": "gradio.FileData"}, "orig_name": "prompt.wav"}
        save_index, save_inputs = events["save"]
        assert len(save_inputs) == 3  # name, prompt, transcript
        save = [["Mine", audio, TRANSCRIPT], events["save"][0]]
        rename, export, delete = events["rename"][0], events["export"][0], events["confirm-delete"][0]
    with httpx.Client(base_url=url, timeout=60) as anon:
        for index, data in ((save[1], save[0]), (rename, ["any", "Stolen"]), (export, ["any"]),
                            (delete, ["any"])):
            assert call_event(anon, index, data).status_code == 401
    assert not [v for v in studio.service.list_voices() if v.name]  # nothing was saved

    with httpx.Client(base_url=url, timeout=60, headers=BEARER) as owner:
        done = call_event(owner, save_index, save[0], "owner1")
        assert done["success"], done
        [mine] = studio.service.list_voices()
        assert mine.name == "Mine"
        with httpx.Client(base_url=url, timeout=60) as anon:  # the saved voice is still out of a stranger's reach
            for index, data in ((rename, [mine.id, "Stolen"]), (export, [mine.id]), (delete, [mine.id])):
                assert call_event(anon, index, data).status_code == 401
        assert [v.name for v in studio.service.list_voices()] == ["Mine"]
        assert call_event(owner, rename, [mine.id, "Renamed"], "owner1")["success"]
        assert [v.name for v in studio.service.list_voices()] == ["Renamed"]
        exported = call_event(owner, export, [mine.id], "owner1")["output"]["data"][0]
        assert exported["orig_name"] == "Renamed.voice.safetensors"
        assert owner.get(exported["url"]).status_code == 200
        assert httpx.get(exported["url"]).status_code == 401  # the file route too
        assert call_event(owner, delete, [mine.id], "owner1")["success"]
        assert not [v for v in studio.service.list_voices() if v.name]


def test_gradio_client_needs_the_key(keyed: tuple, short_prompt_wav: Path) -> None:
    from gradio_client import Client, handle_file

    _, url = keyed
    with pytest.raises(ValueError, match="credentials were not provided"):
        Client(url, verbose=False)
    client = Client(url, verbose=False, headers={"Authorization": "Bearer second-key"})
    saved = client.predict(name="Keyed", prompt_audio=handle_file(str(short_prompt_wav)), prompt_text=TRANSCRIPT,
                           api_name="/save_voice")
    assert saved["name"] == "Keyed"
    assert "Keyed" in [v["name"] for v in client.predict(api_name="/voices")]
    path = client.predict(text="Hi.", mode="cross_lingual", voice="Keyed", seed=1, api_name="/synthesize")
    assert Path(path).stat().st_size > 44
