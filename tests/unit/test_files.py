"""pdcore/files.py: the small files settings name, and where a command writes its result."""
from __future__ import annotations

import os

import pytest

from pdcore.files import output_file_problem, read_small_text


def test_output_file_problem_before_a_long_run(tmp_path):
    assert output_file_problem(str(tmp_path / "r.json")) is None  # new file
    assert output_file_problem(str(tmp_path / "a" / "b" / "r.json")) is None  # folders made
    (tmp_path / "old.json").write_text("{}")
    assert output_file_problem(str(tmp_path / "old.json")) is None  # replaced
    assert "is a folder" in output_file_problem(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in output_file_problem(str(fifo))  # a write would block
    (tmp_path / "plain").write_text("x")
    assert "is not a folder" in output_file_problem(str(tmp_path / "plain" / "r.json"))
    assert output_file_problem("") == "the path is empty"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_output_file_problem_names_a_folder_it_cannot_write(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert "is not writable" in output_file_problem(str(ro / "r.json"))
    finally:
        ro.chmod(0o700)


def test_read_small_text_refuses_what_is_not_a_small_regular_file(tmp_path):
    (tmp_path / "k").write_text("key\n")
    assert read_small_text(str(tmp_path / "k"), "key file") == "key\n"
    with pytest.raises(ValueError, match="is not a regular file"):
        read_small_text(str(tmp_path), "key file")
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match="larger than 10 bytes"):
        read_small_text(str(tmp_path / "big"), "key file", limit=10)
