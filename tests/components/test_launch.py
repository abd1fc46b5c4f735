from components.launch import ALL, LOCAL, parse_args, server_name


def test_local_by_default_everywhere_on_spaces_or_share():
    assert server_name(None, False, {}) == LOCAL
    assert server_name(None, False, {"SPACE_ID": "user/flashspec"}) == ALL
    assert server_name(None, True, {}) == ALL
    assert server_name("192.168.1.5", True, {"SPACE_ID": "x"}) == "192.168.1.5"


def test_parse_args():
    args = parse_args(["--host", "0.0.0.0", "--port", "8000", "--share", "--no-preload"])
    assert (args.host, args.port, args.share, args.no_preload) == ("0.0.0.0", 8000, True, True)
    args = parse_args([])
    assert args.host is None and not args.share
