"""A `logging_option` sync mark tells a worker where a proc's lines after it go (`log_destination_after`): to the
owner, or printed where the proc runs; text without a mark leaves the destination as it was."""

from regent.actor._spawner import LOG_SYNC_MARK, LOG_TO_HOST, LOG_TO_OWNER, log_destination_after


def test_the_marks_token_names_the_destination_and_keeps_the_text_before_it():
    assert log_destination_after(f"{LOG_SYNC_MARK}logsync-1{LOG_TO_OWNER}\n") == ("", True)
    assert log_destination_after(f"partial{LOG_SYNC_MARK}logsync-2{LOG_TO_HOST}\n") == ("partial", False)


def test_a_line_without_a_mark_or_with_an_old_token_changes_nothing():
    assert log_destination_after("[printers gpus=0] loss 0.1\n") == ("[printers gpus=0] loss 0.1\n", None)
    assert log_destination_after(f"{LOG_SYNC_MARK}logsync-3\n") == ("", None)
