from model_factory import make_tokenizer

from tpserve.detokenizer import IncrementalDetokenizer

TOK = make_tokenizer(384)


def stream(text: str, stop=None, prompt="x = 1\n"):
    prompt_ids = TOK.encode(prompt, add_special_tokens=False)
    ids = TOK.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(TOK, prompt_ids, stop)
    pieces, stopped = [], False
    for t in ids:
        d.add([t])
        if d.find_stop():
            stopped = True
            break
        pieces.append(d.take_new_text())
    pieces.append(d.take_new_text(final=True))
    return pieces, stopped, d


def test_pieces_concatenate_to_the_full_decode():
    text = "def f(x):\n    return x * 2  # ünïcödé ✓ 漢字\n"
    pieces, stopped, _ = stream(text)
    assert not stopped
    assert "".join(pieces) == TOK.decode(TOK.encode(text, add_special_tokens=False))
    assert len([p for p in pieces if p]) > 3  # it really streamed


def test_stop_string_cuts_text_before_it_and_never_leaks():
    pieces, stopped, d = stream("alpha beta STOP gamma", stop=["STOP"])
    assert stopped
    assert "".join(pieces) == "alpha beta "
    assert all("S" not in p for p in pieces)


def test_earliest_of_several_stop_strings_wins():
    pieces, stopped, _ = stream("one two three four", stop=["four", "two"])
    assert stopped and "".join(pieces) == "one "
