from dshim.cli import main

main()
