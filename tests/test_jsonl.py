"""The JSONL contract's input side and resumable output, without processes."""

from __future__ import annotations

import json

import pytest

from fusion.data.hdf5 import DataError
from fusion.data.jsonl import ResumableWriter, find_files, output_path, parse_file

NAMES = {"llama", "gpt2"}
SOURCES = {"tiny:llama": "llama", "tiny:gpt2": "gpt2"}


def parse(tmp_path, text: str):
    p = tmp_path / "req.jsonl"
    p.write_text(text)
    return parse_file(p, "llama", NAMES, SOURCES).lines


def test_routes_by_model_engine_or_source_else_default(tmp_path):
    lines = parse(tmp_path, "\n".join(json.dumps(r) for r in [
        {"prompt": "a"}, {"prompt": "b", "model": "gpt2"}, {"prompt": "c", "engine": "gpt2"},
        {"prompt": [1, 2], "model": "tiny:gpt2"}]) + "\n\n")
    assert [ln.variant for ln in lines] == ["llama", "gpt2", "gpt2", "gpt2"]
    assert [ln.number for ln in lines] == [1, 2, 3, 4] and all(ln.error is None for ln in lines)


@pytest.mark.parametrize("raw, match", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "a", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON (nested too deeply)"),
    ("[1, 2]", "a request must be a JSON object, got list"),
    ('{"max_tokens": 3}', "prompt is missing or empty"),
    ('{"prompt": ""}', "prompt is missing or empty"),
    ('{"prompt": 5}', "prompt must be text or a list of token IDs, got int"),
    ('{"prompt": [1, "x"]}', "non-empty list of token IDs"),
    ('{"prompt": "a", "model": "gpt-4"}', "unknown model 'gpt-4': this deployment serves gpt2, llama"),
    ('{"prompt": "a", "model": 3}', "model must be a variant name"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "this is a chat request (messages)"),
    # OpenAI's Batch API form: its completions only, its body a request
    ('{"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": []}}', "url must be /v1/completions"),
    ('{"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}', "method must be POST"),
    ('{"custom_id": "c", "url": "/v1/completions", "body": "a"}', "body must be a JSON object"),
    ('{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "a", "model": "gpt-4"}}', "unknown model"),
])
def test_bad_lines_become_errors_naming_file_and_line(tmp_path, raw, match):
    lines = parse(tmp_path, '{"prompt": "ok"}\n' + raw + "\n")
    assert lines[0].error is None
    assert lines[1].variant is None and match in lines[1].error
    assert lines[1].error.startswith("req.jsonl line 2: ")


def test_openai_batch_api_lines_are_served_by_their_body_and_echoed_whole(tmp_path):
    """A line of OpenAI's Batch API input ({custom_id, method, url, body}) serves its body, routed by
    the body's model; the line as given (its custom_id) is what the output record echoes."""
    line = {"custom_id": "req-7", "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt2", "prompt": "hi", "max_tokens": 3}}
    (ln,) = parse(tmp_path, json.dumps(line) + "\n")
    assert ln.error is None and ln.variant == "gpt2" and ln.request == line and ln.body == line["body"]
    (plain,) = parse(tmp_path, '{"prompt": "a", "max_tokens": 2}\n')
    assert plain.body == plain.request == {"prompt": "a", "max_tokens": 2}


def test_find_files_and_output_name(tmp_path):
    with pytest.raises(DataError, match="holds no .jsonl file"):
        find_files(tmp_path)
    with pytest.raises(DataError, match="is not a directory"):
        find_files(tmp_path / "missing")
    (tmp_path / "b.jsonl").write_text("")
    (tmp_path / "a.jsonl").write_text("")
    assert [p.name for p in find_files(tmp_path)] == ["a.jsonl", "b.jsonl"]
    assert output_path(tmp_path / "pred", tmp_path / "request_1.jsonl").name == "output_request_1.jsonl"


def test_writer_resumes_after_a_torn_line_and_renames_when_done(tmp_path):
    final = tmp_path / "out" / "output_x.jsonl"
    w = ResumableWriter(final)
    assert w.done == 0
    w.write({"i": 0})
    w.write({"i": 1})
    w.flush()
    w.close()
    with open(w.partial, "a") as f:
        f.write('{"i": 2, "trunc')  # a crash in the middle of a line
    assert not final.exists()
    w2 = ResumableWriter(final)
    assert w2.done == 2 and w2.partial.read_text().count("\n") == 2
    w2.write({"i": 2})
    w2.finish()
    assert not w2.partial.exists()
    assert [json.loads(x)["i"] for x in final.read_text().splitlines()] == [0, 1, 2]


SEPARATORS = "\u2028\u2029\x85\x1c\x0b\x0c"  # line breaks to str.splitlines(), legal inside JSON strings


def test_text_with_unicode_line_separators_stays_one_record(tmp_path):
    """A generated text holding U+2028 and friends (a random model makes them) is one line of the
    output to any reader, reads back equal, and survives a resume; an input line holding them raw
    (written with ensure_ascii=False) is one request."""
    lines = parse(tmp_path, json.dumps({"prompt": f"a{SEPARATORS}b"}, ensure_ascii=False) + "\r\n" +
                  json.dumps({"prompt": "c"}) + "\n")
    assert [(ln.number, ln.error, ln.request["prompt"]) for ln in lines] == [(1, None, f"a{SEPARATORS}b"),
                                                                             (2, None, "c")]
    final = tmp_path / "out" / "output_req.jsonl"
    recs = [{"i": i, "text": f"{i}{SEPARATORS}é"} for i in range(3)]
    w = ResumableWriter(final)
    w.write(recs[0])
    w.write(recs[1])
    w.close()
    w2 = ResumableWriter(final)  # resuming reads what was written
    assert w2.done == 2
    w2.write(recs[2])
    w2.replace(0, {**recs[0], "again": True})
    w2.finish()
    text = final.read_text(encoding="utf-8")
    assert "é" in text and len(text.splitlines()) == 3
    assert [json.loads(x) for x in text.splitlines()] == [{**recs[0], "again": True}, recs[1], recs[2]]


def test_a_line_whose_escapes_spell_half_a_utf16_pair_is_that_lines_error_and_its_record_writes(tmp_path):
    """JSON's escapes can spell a lone surrogate ("\\ud800"), which is no text: that line's error names
    where it is, its record keeps the line as read (the parsed one could not be written), and the
    lines around it are served."""
    p = tmp_path / "req.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": "b\\ud800"}\n{"prompt": "c", "stop": ["\\udc00"]}\n'
                 '{"prompt": "\\ud83d\\ude00"}\n')
    lines = parse_file(p, "llama", NAMES, SOURCES).lines
    assert [(ln.number, ln.error) for ln in lines] == [
        (1, None), (2, "req.jsonl line 2: prompt holds a lone UTF-16 surrogate (\\ud800), which is not Unicode text"),
        (3, "req.jsonl line 3: stop[0] holds a lone UTF-16 surrogate (\\udc00), which is not Unicode text"), (4, None)]
    assert lines[1].request == '{"prompt": "b\\ud800"}' and lines[3].request == {"prompt": "\U0001F600"}
    w = ResumableWriter(tmp_path / "out" / "output_req.jsonl")
    for ln in lines:
        w.write({"request": ln.request, "error": ln.error})
    w.finish()
    records = [json.loads(x) for x in (tmp_path / "out" / "output_req.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["request"] for r in records] == [ln.request for ln in lines]


def test_a_byte_order_mark_is_read_past_and_a_line_not_utf8_is_that_lines_error(tmp_path):
    """A file written with a byte order mark (as some Windows tools do) serves its first line; a line
    that is not UTF-8 is an error naming the line and the byte, and the lines around it are served."""
    p = tmp_path / "req.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b\xff"}\n{"prompt": "\xc3\xa9"}\n')
    lines = parse_file(p, "llama", NAMES, SOURCES).lines
    assert [(ln.number, ln.error) for ln in lines] == [
        (1, None), (2, "req.jsonl line 2: not UTF-8 text (byte 0xff at column 14)"), (3, None)]
    assert lines[0].request == {"prompt": "a"} and lines[2].request == {"prompt": "é"}
