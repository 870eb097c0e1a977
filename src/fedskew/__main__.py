from fedskew.cli import main

main()
