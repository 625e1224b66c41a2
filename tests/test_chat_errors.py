"""A chat template that fails, breaks or never ends, through the CLI: one line naming the record (or the
template) and quoting its message, exit 2, no traceback; with --on-error skip the record is counted.
The bundled tokenizer with --chat-template files (the errors do not depend on the tokenizer)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner
from conftest import one_line
from test_chat import write_jsonl

from packer.building import chat
from packer.building.timelimit import TimeLimitExceeded, time_limit
from packer.cli import main
from packer.errors import RecordError

OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def record(trigger: str) -> dict:
    return {"messages": [{"role": "user", "content": trigger}, {"role": "assistant", "content": "hello"}]}


# Plain ChatML, plus code that fails (or loops 10^10 times) when the first message says so
def template(failing: str) -> str:
    return ("{% if messages[0].content == 'bad' %}" + failing + "{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


FAILURES = {
    "TypeError": ("{{ messages[0].content + 1 }}", "TypeError"),
    "ZeroDivisionError": ("{{ 1 // (messages | length - messages | length) }}", "ZeroDivisionError"),
    "raise_exception": ("{{ raise_exception('only one user turn please') }}", "only one user turn please"),
}
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def build(tmp_path, jinja: str, records: list[dict], *extra: str):
    (tmp_path / "t.jinja").write_text(jinja)
    src = write_jsonl(tmp_path / "c.jsonl", records)
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    return CliRunner().invoke(main, ["build", str(src), "--chat-template", str(tmp_path / "t.jinja"),
                                     "--out", str(out), "-q", *extra])




def skipped(result) -> dict:
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)["stats"]["dropped_by_reason"]


@pytest.mark.parametrize("kind", FAILURES)
def test_a_template_that_raises_is_a_record_error(tmp_path, kind):
    jinja, quoted = FAILURES[kind]
    line = one_line(build(tmp_path, template(jinja), [OK, record("bad")], "-j", "1"))
    assert "c.jsonl record 2: " in line and "the chat template refused the conversation" in line
    assert quoted in line and "--on-error skip" in line
    result = build(tmp_path, template(jinja), [OK, record("bad"), OK], "-j", "1", "--on-error", "skip", "--json")
    assert skipped(result) == {"chat_template_error": 1}


def test_a_syntax_error_names_the_template_before_any_record(tmp_path):
    line = one_line(build(tmp_path, template("{% for x in %}"), [OK], "-j", "1"))
    assert "--chat-template" in line and "t.jinja" in line and "not valid Jinja" in line and "record" not in line
    # --on-error skip does not turn a broken template into dropped records
    line = one_line(build(tmp_path, "{{ messages", [OK], "-j", "1", "--on-error", "skip"))
    assert "not valid Jinja" in line and "record" not in line


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_endless_template_ends_with_one_line(tmp_path, monkeypatch, jobs):
    """A 10^10-step loop: stopped by the per-record time limit, in the CLI's process (-j 1) and in pool
    workers (-j 2, forked, so they inherit the shortened limit)."""
    monkeypatch.setattr(chat, "RENDER_TIME_LIMIT_S", 0.5)  # each endless record costs the limit: keep it short
    start = time.monotonic()
    line = one_line(build(tmp_path, template(ENDLESS), [OK, record("bad")], "-j", jobs))
    assert "record 2" in line and "did not finish rendering the conversation within 0.5 s" in line
    result = build(tmp_path, template(ENDLESS), [record("bad"), OK, OK], "-j", jobs, "--on-error", "skip", "--json")
    assert skipped(result) == {"chat_template_timeout": 1}
    assert time.monotonic() - start < 30


def test_time_limit_outside_the_main_thread(monkeypatch):
    """Where no signal can be taken (a thread), an endless template still ends, and the next render runs."""
    monkeypatch.setattr(chat, "RENDER_TIME_LIMIT_S", 0.5)
    renderer = chat.ChatTemplate(template(ENDLESS), {"eos_token": "</s>"}, "t.jinja")
    outcome = []

    def work():
        try:
            renderer.render(record("bad")["messages"])
        except RecordError as e:
            outcome.append(e.reason)
        outcome.append(renderer.render(OK["messages"])[0].count("<|im_end|>"))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(20)
    assert outcome == ["chat_template_timeout", 2]


def test_time_limit_in_the_main_thread_restores_the_alarm_handler():
    import signal

    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(TimeLimitExceeded), time_limit(0.2):
        while True:
            pass
    with time_limit(0.2):
        pass
    time.sleep(0.3)  # the alarm was cancelled: nothing fires after the block
    assert signal.getsignal(signal.SIGALRM) == before


def test_a_template_that_never_ends_on_any_conversation(tmp_path, monkeypatch):
    """The probe renders that learn the template's turn ends time out too: the first record's error, once."""
    monkeypatch.setattr(chat, "RENDER_TIME_LIMIT_S", 0.5)
    line = one_line(build(tmp_path, ENDLESS + template(""), [OK, OK], "-j", "1"))
    assert "record 1" in line and "did not finish rendering the conversation within 0.5 s" in line
