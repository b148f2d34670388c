from dshim.launch import main

main()
