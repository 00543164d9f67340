from megalm.serve import main

main()
