from dshim.entry import main

main()
