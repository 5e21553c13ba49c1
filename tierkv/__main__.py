from tierkv.ops.cli import main

main()
