"""The inbox folder's safety: only regular files directly inside it, under plain names, are ever
listed, hashed or read; nothing follows a symlink, however late it is planted; an oversize file
is refused before a byte of it is read; archiving never loses an upload."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from mostovik_pipelines.core.errors import DataValidationError
from mostovik_pipelines.resources import inbox as inbox_module
from mostovik_pipelines.resources.inbox import InboxResource, file_name_of, version_key
from mostovik_pipelines_tests.support.inbox import drop, version_of

CONTENT = "Дата поставки;Объект;Накладная\n01.11.2026;МСК-ЖК-014;00784512\n".encode()


@pytest.fixture
def folders(tmp_path) -> tuple[Path, Path]:
    inbox, archive = tmp_path / "inbox", tmp_path / "archive"
    inbox.mkdir()
    return inbox, archive


@pytest.fixture
def resource(folders) -> InboxResource:
    inbox, archive = folders
    return InboxResource(inbox_dir=str(inbox), archive_dir=str(archive), max_file_bytes=4096)


def _listed(resource: InboxResource) -> list[str]:
    return sorted(file.name for file in resource.files())


def _refused(call, *args) -> BaseException:
    with pytest.raises(Exception) as refused:  # any refusal, as long as nothing is read
        call(*args)
    return refused.value


def test_only_regular_files_with_plain_names_are_listed(resource, folders, tmp_path):
    inbox, _ = folders
    outside = tmp_path / "secret.csv"
    outside.write_bytes(CONTENT)
    drop(inbox, "Поставки ноябрь.csv", CONTENT)
    drop(inbox, "report@site.xlsx", CONTENT)
    (inbox / "link_out.csv").symlink_to(outside)
    (inbox / "link_in.csv").symlink_to(inbox / "Поставки ноябрь.csv")
    (inbox / "link_dir").symlink_to(tmp_path)
    (inbox / "subfolder").mkdir()
    (inbox / "subfolder" / "nested.csv").write_bytes(CONTENT)
    os.mkfifo(inbox / "pipe.csv")
    for hidden in (".hidden.csv", ".~lock.Поставки.csv#", "~$Поставки.xlsx", "upload.csv.part",
                   "upload.csv.tmp", "download.xlsx.crdownload"):
        (inbox / hidden).write_bytes(CONTENT)

    assert _listed(resource) == ["report@site.xlsx", "Поставки ноябрь.csv"]
    listed = {file.name: file for file in resource.files()}
    assert listed["Поставки ноябрь.csv"].size == len(CONTENT)


def test_nothing_but_a_listed_file_is_ever_hashed(resource, folders, tmp_path):
    inbox, _ = folders
    outside = tmp_path / "secret.csv"
    outside.write_bytes(CONTENT)
    drop(inbox, "real.csv", CONTENT)
    (inbox / "link_out.csv").symlink_to(outside)
    (inbox / "link_in.csv").symlink_to(inbox / "real.csv")
    (inbox / "subfolder").mkdir()
    for name in (".hidden.csv", "~$lock.xlsx", "upload.csv.part"):
        (inbox / name).write_bytes(CONTENT)

    assert resource.content_hash("real.csv") == hashlib.sha256(CONTENT).hexdigest()
    for name in ("link_out.csv", "link_in.csv", "subfolder", ".hidden.csv", "~$lock.xlsx",
                 "upload.csv.part", "../secret.csv", "subfolder/../real.csv", ""):
        _refused(resource.content_hash, name)


@pytest.mark.parametrize("name", ["link_out.csv", "link_in.csv"])
def test_a_symlink_is_never_read_as_a_version(name, resource, folders, tmp_path):
    inbox, _ = folders
    target = tmp_path / "secret.csv" if name == "link_out.csv" else inbox / "real.csv"
    target.write_bytes(CONTENT)
    (inbox / name).symlink_to(target)
    error = _refused(resource.read_version, version_of(name, CONTENT))
    assert "neither in the inbox" in str(error)


def test_a_symlink_planted_after_the_listing_is_not_followed(resource, folders, tmp_path):
    inbox, _ = folders
    version = drop(inbox, "Поставки.csv", CONTENT)
    assert _listed(resource) == ["Поставки.csv"]
    # The listed file is swapped for a link to a file of the very same bytes elsewhere.
    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_bytes(CONTENT)
    (inbox / "Поставки.csv").unlink()
    (inbox / "Поставки.csv").symlink_to(elsewhere)
    _refused(resource.read_version, version)


def test_a_symlink_swapped_in_between_the_check_and_the_open_is_not_followed(
    resource, folders, tmp_path, monkeypatch
):
    """The tightest race: the file is a regular file when read_version looks at it and a link
    when it opens it. Opening without following links refuses it."""
    inbox, _ = folders
    version = drop(inbox, "Поставки.csv", CONTENT)
    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_bytes(CONTENT)
    real_lstat = Path.lstat

    def lstat_then_swap(path: Path):
        info = real_lstat(path)
        if path.name == "Поставки.csv" and not path.is_symlink():
            path.unlink()
            path.symlink_to(elsewhere)
        return info

    monkeypatch.setattr(Path, "lstat", lstat_then_swap)
    _refused(resource.read_version, version)


def test_an_oversize_file_is_refused_before_it_is_read(resource, folders, monkeypatch):
    inbox, _ = folders
    name = "huge.csv"
    with (inbox / name).open("wb") as handle:
        handle.truncate(resource.max_file_bytes + 1)  # sparse: its size, none of its bytes
    reads = []
    monkeypatch.setattr(inbox_module, "_read_no_follow", lambda path: reads.append(path))
    error = _refused(resource.read_version, version_key(name, "0" * 64))
    assert isinstance(error, DataValidationError)
    assert "huge.csv" in str(error) and f"over the {resource.max_file_bytes}-byte limit" in str(
        error)
    assert reads == []


def test_a_file_at_the_size_limit_is_read(resource, folders):
    inbox, _ = folders
    content = CONTENT * (resource.max_file_bytes // len(CONTENT))
    content += b"x" * (resource.max_file_bytes - len(content))
    version = drop(inbox, "at_limit.csv", content)
    assert resource.read_version(version)[0] == content


def test_a_fifo_is_never_opened(resource, folders):
    """A named pipe would block a reader forever: it is neither listed nor read."""
    inbox, _ = folders
    os.mkfifo(inbox / "pipe.csv")
    assert _listed(resource) == []
    done = threading.Event()

    def read():
        with contextlib.suppress(Exception):  # refused is what is expected
            resource.read_version(version_key("pipe.csv", "0" * 64))
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5), "read_version blocked on a named pipe"


def test_a_version_of_a_name_the_inbox_never_lists_is_never_read(resource, folders):
    """Partition keys come from the sensor, but anyone may add a partition in the UI and run
    it: read_version must apply the inbox's own rules (plain names only), not only files()."""
    inbox, _ = folders
    names = (".hidden.csv", "~$Поставки.xlsx", "upload.csv.part", "upload.csv.tmp",
             "../outside.csv", "subfolder/nested.csv")
    read = []
    for name in names:
        path = inbox / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(CONTENT)
        assert file_name_of(version_of(name, CONTENT)) == name
        try:
            resource.read_version(version_of(name, CONTENT))
        except Exception:  # refused, as it must be
            continue
        read.append(name)
    assert _listed(resource) == []
    assert read == [], f"read_version read {read}, names files() never lists"


def test_a_version_is_read_from_the_inbox_then_from_the_archive(resource, folders):
    inbox, archive = folders
    version = drop(inbox, "Поставки.csv", CONTENT)
    content, modified = resource.read_version(version)
    assert content == CONTENT
    assert modified.timestamp() == pytest.approx((inbox / "Поставки.csv").stat().st_mtime)

    resource.archive(version, "loaded", "run-1")
    assert _listed(resource) == []
    assert (archive / version).read_bytes() == CONTENT
    assert resource.read_version(version) == (content, modified)
    # A version neither place holds, e.g. replaced by a newer upload before it was loaded.
    error = _refused(resource.read_version, version_of("Поставки.csv", b"other bytes"))
    assert "neither in the inbox" in str(error)


def test_archiving_moves_the_version_with_a_note_of_its_outcome(resource, folders):
    inbox, archive = folders
    version = drop(inbox, "Поставки.csv", CONTENT)
    resource.archive(version, "partial", "run-1")
    assert list(inbox.iterdir()) == []
    note = json.loads((archive / f"{version}.outcome.json").read_text())
    assert {k: note[k] for k in ("file", "version", "outcome", "run_id")} == {
        "file": "Поставки.csv", "version": version, "outcome": "partial", "run_id": "run-1"}


def test_archiving_an_older_version_leaves_a_newer_upload_in_the_inbox(resource, folders):
    inbox, archive = folders
    old = version_of("Поставки.csv", CONTENT)
    drop(inbox, "Поставки.csv", CONTENT + b"corrected\n")
    resource.archive(old, "loaded", "run-1")
    assert (inbox / "Поставки.csv").read_bytes() == CONTENT + b"corrected\n"
    assert not (archive / old).exists()


def test_an_upload_landing_while_the_previous_version_is_archived_stays_in_the_inbox(
    resource, folders, monkeypatch
):
    """archive() moves the file aside before hashing it: a corrected upload that replaced the
    loaded version goes back to the inbox, and one landing while the moved file is hashed stays
    there while the moved one is archived under its own version; nothing is lost or
    misnamed."""
    from mostovik_pipelines.resources import inbox as inbox_module

    inbox, archive = folders
    old = drop(inbox, "Поставки.csv", CONTENT)
    corrected = CONTENT + b"corrected\n"
    drop(inbox, "Поставки.csv", corrected)  # replaced before the archiving starts
    resource.archive(old, "loaded", "run-1")
    assert not (archive / old).exists(), "the archive's old version holds the corrected upload"
    assert (inbox / "Поставки.csv").read_bytes() == corrected

    newest = CONTENT + b"newest\n"
    real_sha256 = inbox_module._sha256

    def hash_while_another_upload_lands(path):
        drop(inbox, "Поставки.csv", newest)
        return real_sha256(path)

    monkeypatch.setattr(inbox_module, "_sha256", hash_while_another_upload_lands)
    resource.archive(old, "loaded", "run-2")
    assert (inbox / "Поставки.csv").read_bytes() == newest
    corrected_version = inbox_module.version_key(
        "Поставки.csv", hashlib.sha256(corrected).hexdigest())
    assert (archive / corrected_version).read_bytes() == corrected
